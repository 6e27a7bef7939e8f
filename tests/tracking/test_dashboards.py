"""What the dashboards show, read back over MLflow's REST API from a real `mlflow server` (tests/conftest.py
`mlflow_server`): experiment kind, run names and provenance, evaluation on the training run and its child runs,
report.md links, dataset input, failure reasons, system metrics per node."""

from __future__ import annotations

import io
import json
import urllib.parse
import urllib.request
from types import SimpleNamespace

import pytest

from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.tracking.evaluation import child_run_name, eval_params, log_evaluation
from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink
from embodyhpc.tracking.provenance import log_dataset, source_tags
from embodyhpc.tracking.telemetry import TelemetrySampler

pytestmark = pytest.mark.slow  # the server takes 9-30 s to answer /health on a shared machine


def rest(uri: str, endpoint: str, **query) -> dict:
    url = f"{uri}/api/2.0/mlflow/{endpoint}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def raw(uri: str, path: str) -> bytes:
    with urllib.request.urlopen(f"{uri}/{path}", timeout=30) as response:
        return response.read()


def run_of(uri: str, run_id: str) -> dict:
    run = rest(uri, "runs/get", run_id=run_id)["run"]
    data = run["data"]
    run["tags"] = {t["key"]: t["value"] for t in data.get("tags", [])}
    run["params"] = {p["key"]: p["value"] for p in data.get("params", [])}
    run["metrics"] = {m["key"]: m for m in data.get("metrics", [])}
    return run


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    found = rest(uri, "metrics/get-history", run_id=run_id, metric_key=key).get("metrics", [])
    return sorted((int(m.get("step", 0)), m["value"]) for m in found)


def artifacts(uri: str, run_id: str, path: str = "") -> dict[str, int | None]:
    listed = rest(uri, "artifacts/list", run_id=run_id, **({"path": path} if path else {}))
    return {f["path"]: f.get("file_size") for f in listed.get("files", [])}


def results(rate_by_task: dict[str, tuple[int, int]], planned: int) -> dict:
    """A report's results (to_dict form) with `rate_by_task` {task: (successes, recorded)} for policy trained."""
    from embodyhpc.eval.aggregate import Stats

    tasks = {task: Stats.of([{"success": i < s, "return": 1.0 * i, "length": 10 + i} for i in range(n)], planned)
             for task, (s, n) in rate_by_task.items()}
    everything = [{"success": i < s, "return": 1.0 * i, "length": 10 + i}
                  for s, n in rate_by_task.values() for i in range(n)]
    overall = Stats.of(everything, planned * len(tasks))
    as_dict = lambda stats: {**stats.__dict__}  # noqa: E731
    return {"policies": {"trained": {"overall": as_dict(overall), "tasks": {t: as_dict(x) for t, x in tasks.items()}}}}


EVAL = SimpleNamespace(suite="metaworld", seeds=[100], episodes_per_task=5, execute_steps=5, denoise_steps=10,
                       max_steps=200, reference_policies=["expert", "random"], suite_options={})


def test_experiment_kind_names_provenance_and_recipe(mlflow_server, tmp_path):
    uri = mlflow_server
    from mlflow import MlflowClient

    MlflowClient(uri).create_experiment("made-by-hand")  # an experiment without a kind gets one
    run_id = mr.create_run(uri, experiment="made-by-hand", run_name=mr.run_display_name(
        "demo-metaworld-20261125-170417-2", "demo-metaworld"), tags=source_tags("recipes/demo_metaworld_cpu.yaml"),
        description="**pi05** trained", texts={"recipe/overrides.txt": "train.lr=1e-3\nsite.env.HF_TOKEN=***\n"})
    experiment = rest(uri, "experiments/get-by-name", experiment_name="made-by-hand")["experiment"]
    assert {t["key"]: t["value"] for t in experiment["tags"]}["mlflow.experimentKind"] == "custom_model_development"
    run = run_of(uri, run_id)
    assert run["info"]["run_name"] == "170417-2 demo-metaworld 20261125"  # what differs first
    assert run["tags"]["mlflow.note.content"] == "**pi05** trained"
    assert run["tags"]["mlflow.source.name"] == "embodyhpc submit recipes/demo_metaworld_cpu.yaml"
    assert len(run["tags"]["mlflow.source.git.commit"]) == 40 and run["tags"]["mlflow.user"]
    assert artifacts(uri, run_id, "recipe") == {"recipe/overrides.txt": 36}
    # a kind set by someone else stays
    MlflowClient(uri).set_experiment_tag(experiment["experiment_id"], "mlflow.experimentKind", "genai_development")
    mr.create_run(uri, experiment="made-by-hand", run_name="x")
    experiment = rest(uri, "experiments/get-by-name", experiment_name="made-by-hand")["experiment"]
    assert {t["key"]: t["value"] for t in experiment["tags"]}["mlflow.experimentKind"] == "genai_development"
    assert mr.run_display_name("my-run", "demo") == "my-run"  # not a run folder name: kept


def test_evaluations_reach_the_training_run_and_child_runs_carry_everything(mlflow_server, tmp_path):
    uri = mlflow_server
    run_id = mr.create_run(uri, experiment="dash-eval", run_name="train", status="RUNNING")
    plots = tmp_path / "plots"
    plots.mkdir()
    png = plots / "task_success.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(64)))
    summary = tmp_path / "report.md"
    summary.write_text("# Evaluation\n\n![task success](plots/task_success.png)\n![ext](https://x.org/a.png)\n")
    tasks = ["reach-v3", "door-open-v3"]
    children = {}
    for step, rates, outcome in [(200, {"reach-v3": (1, 5), "door-open-v3": (2, 5)}, "complete"),
                                 (400, {"reach-v3": (3, 5), "door-open-v3": (5, 5)}, "complete"),
                                 (600, {"reach-v3": (2, 3), "door-open-v3": (5, 5)}, "incomplete")]:
        params = eval_params(EVAL, step=step, weights=f"/runs/x/checkpoints/step-{step}", tasks=tasks)
        start, end = 1_700_000_000_000 + step * 1000, 1_700_000_000_000 + step * 1000 + 95_000
        children[step] = log_evaluation(
            uri, run_id, step=step, results=results(rates, 5), params=params, outcome=outcome,
            why="all shards reported" if outcome == "complete" else "1 of 2 evaluation shards missing: [1]",
            summary=summary, artifacts=[(png, "plots")], start_ms=start, end_ms=end)
    # the training run: one point per evaluated step, with its interval: MLflow's learning curve
    assert history(uri, run_id, "eval/trained/success_rate") == [(200, 0.3), (400, 0.8), (600, 7 / 8)]
    lows = history(uri, run_id, "eval/trained/success_ci_low")
    highs = history(uri, run_id, "eval/trained/success_ci_high")
    assert [s for s, _ in lows] == [s for s, _ in highs] == [200, 400, 600]
    assert all(lo < rate < hi for (_, lo), (_, rate), (_, hi)
               in zip(lows, history(uri, run_id, "eval/trained/success_rate"), highs, strict=True))

    child = run_of(uri, children[400])
    assert child["tags"]["mlflow.parentRunId"] == run_id
    assert child["info"]["run_name"] == child_run_name(eval_params(EVAL, step=400, weights="/runs/x/checkpoints/"
                                                                   "step-400", tasks=tasks))
    assert child["info"]["run_name"].startswith("step 400 eval ")
    assert child["params"]["suite"] == "metaworld" and json.loads(child["params"]["tasks"]) == tasks
    assert (child["params"]["seeds"], child["params"]["episodes_per_task"]) == ("[100]", "5")
    assert (child["params"]["execute_steps"], child["params"]["denoise_steps"]) == ("5", "10")
    assert (child["params"]["checkpoint_step"], child["params"]["weights"]) == ("400", "/runs/x/checkpoints/step-400")
    metrics = {key: (m["value"], int(m["step"])) for key, m in child["metrics"].items()}
    assert metrics["eval/trained/reach-v3/success_rate"] == (0.6, 400)
    low, high = metrics["eval/trained/reach-v3/success_ci_low"][0], metrics["eval/trained/reach-v3/success_ci_high"][0]
    assert low < 0.6 < high
    assert metrics["eval/trained/reach-v3/mean_return"] == (2.0, 400)  # returns 0..4
    assert metrics["eval/trained/reach-v3/mean_length"] == (12.0, 400)
    assert metrics["eval/trained/episodes_missing"] == (0.0, 400)
    # the evaluation's own times, not those of logging
    assert (int(child["info"]["start_time"]), int(child["info"]["end_time"])) == (1_700_000_400_000,
                                                                                1_700_000_495_000)
    assert child["info"]["status"] == "FINISHED"
    # report.md links its images to the child's artifacts, which the server serves
    markdown = raw(uri, f"get-artifact?path=report.md&run_uuid={children[400]}").decode()
    assert f"![task success](get-artifact?path=plots%2Ftask_success.png&run_uuid={children[400]})" in markdown
    assert "![ext](https://x.org/a.png)" in markdown
    assert raw(uri, f"get-artifact?path=plots%2Ftask_success.png&run_uuid={children[400]}") == png.read_bytes()
    # an incomplete evaluation is not green: FAILED, with why
    failed = run_of(uri, children[600])
    assert failed["info"]["status"] == "FAILED"
    assert failed["tags"]["embodyhpc.failure_reason"] == "1 of 2 evaluation shards missing: [1]"
    assert metrics != {key: (m["value"], int(m["step"])) for key, m in failed["metrics"].items()}
    # successive checkpoints evaluated alike share the hash; different settings at one checkpoint do not
    assert run_of(uri, children[200])["info"]["run_name"].split(" ")[-1] == child["info"]["run_name"].split(" ")[-1]
    other = eval_params(SimpleNamespace(**{**EVAL.__dict__, "denoise_steps": 4}), step=400,
                        weights="/runs/x/checkpoints/step-400", tasks=tasks)
    assert child_run_name(other) != child["info"]["run_name"] and child_run_name(other).startswith("step 400 eval ")


def test_failure_reason_dataset_input_and_system_metrics(mlflow_server):
    uri = mlflow_server
    run_id = mr.create_run(uri, experiment="dash-train", run_name="train", description="trained on demos")
    log_dataset(uri, run_id, name="metaworld-mt4", path="/data/metaworld-mt4", num_episodes=98,
                fingerprint="ab" * 32, profile={"num_frames": 6855})
    inputs = rest(uri, "runs/get", run_id=run_id)["run"]["inputs"]["dataset_inputs"]
    (dataset,) = [d["dataset"] for d in inputs]
    assert (dataset["name"], dataset["digest"]) == ("metaworld-mt4", ("ab" * 32)[:36])
    assert json.loads(dataset["source"]) == {"uri": "/data/metaworld-mt4"}
    assert json.loads(dataset["profile"])["num_episodes"] == 98
    assert {t["key"]: t["value"] for t in inputs[0]["tags"]}["mlflow.data.context"] == "training"

    # telemetry of two nodes: MLflow's system-metric names, per node, continuing after a requeue
    for node in (0, 1):
        sink = MlflowMetricsSink(uri, run_id, owns_status=False, flush_every=1)
        sampler = TelemetrySampler(sink, node=f"host{node}", node_index=node, warn=lambda line: None,
                                   first_step=sink.next_step(f"system/node_{node}/"))
        sampler.open()
        sampler.sample_once()
        sampler.sample_once()
        sampler.stop()
        sink.close()
    sink = MlflowMetricsSink(uri, run_id, owns_status=False)
    assert sink.next_step("system/node_1/") == 2  # a requeued job goes on at 2
    sampler = TelemetrySampler(sink, node="host1", node_index=1, first_step=sink.next_step("system/node_1/"))
    sampler.open()
    sampler.sample_once()
    sampler.stop()
    sink.close()
    keys = set(run_of(uri, run_id)["metrics"])
    assert {"system/node_0/cpu_utilization_percentage", "system/node_1/system_memory_usage_megabytes"} <= keys
    assert not [k for k in keys if not k.startswith("system/node_")]
    assert [s for s, _ in history(uri, run_id, "system/node_1/cpu_utilization_percentage")] == [0, 1, 2]

    # a failed attempt: FAILED with why, in a tag and in the description
    err = io.StringIO()
    train_sink = MlflowMetricsSink(uri, run_id, prefix="train/", stream=err)
    train_sink.write(10, {"loss": 1.0})
    train_sink.close("FAILED", reason="RuntimeError: CUDA out of memory\n  at step 10")
    run = run_of(uri, run_id)
    assert run["info"]["status"] == "FAILED"
    assert run["tags"]["embodyhpc.failure_reason"] == "RuntimeError: CUDA out of memory at step 10"
    assert run["tags"]["mlflow.note.content"] == ("trained on demos\n\n**Failed:** RuntimeError: CUDA out of memory "
                                                  "at step 10")
    # the report's backstop does not overwrite an ended run's reason
    assert not mr.set_terminated(uri, run_id, "FAILED", only_if_active=True, reason="training did not finish")
    assert run_of(uri, run_id)["tags"]["embodyhpc.failure_reason"].startswith("RuntimeError")
