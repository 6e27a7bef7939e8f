"""What the report job and the training sink log, read back from a real sqlite store without a server: the fast
loop's check of the logging paths tests/tracking/test_dashboards.py reads over REST (that file keeps the server's
own parts: REST answers, artifact routes, the UI's links).

The inputs are written out by hand (a report's results in to_dict form), so every expected value is a number the
test chose, not one the code under test computed: a logging path passes values through or it does not.
"""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest

from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.tracking.evaluation import child_run_name, eval_params, log_evaluation, mlflow_markdown
from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink

EVAL = SimpleNamespace(suite="metaworld", seeds=[100], episodes_per_task=5, execute_steps=5, denoise_steps=10,
                       max_steps=200, reference_policies=["expert", "random"], suite_options={})
TASKS = ["reach-v3", "door-open-v3"]
Z = 1.96
ZERO_OF_10_HIGH = Z * Z / (10 + Z * Z)  # Wilson's upper bound at 0 of 10 successes: z^2 / (n + z^2)


def wilson(successes: int, n: int) -> tuple[float, float]:
    """Wilson's score interval (E. B. Wilson, JASA 1927), written here from the formula."""
    p = successes / n
    centre, spread = p + Z * Z / (2 * n), Z * (p * (1 - p) / n + Z * Z / (4 * n * n)) ** 0.5
    return max(0.0, (centre - spread) / (1 + Z * Z / n)), min(1.0, (centre + spread) / (1 + Z * Z / n))


def stats(successes: int, recorded: int, planned: int, *, low: float, high: float, mean_return: float | None,
          mean_length: float | None) -> dict:
    """One Stats in to_dict form, by hand."""
    return {"planned": planned, "recorded": recorded, "successes": successes,
            "success_rate": successes / recorded if recorded else None, "ci_low": low, "ci_high": high,
            "mean_return": mean_return, "mean_length": mean_length}


def policy(overall: dict, **tasks: dict) -> dict:
    return {"overall": overall, "tasks": {task.replace("_", "-"): s for task, s in tasks.items()}}


def results(trained_successes: tuple[int, int]) -> dict:
    """The trained policy with (reach, door) successes of 5 episodes each; random scores nothing (a rate of 0.0
    with a mean return of 0.0); the expert recorded nothing (its shard is missing: no rate at all)."""
    reach, door = trained_successes
    total = reach + door
    low, high = wilson(total, 10)
    trained = policy(stats(total, 10, 10, low=low, high=high, mean_return=float(total), mean_length=40.0),
                     reach_v3=stats(reach, 5, 5, low=0.0, high=0.6, mean_return=float(reach), mean_length=38.0),
                     door_open_v3=stats(door, 5, 5, low=0.0, high=0.6, mean_return=float(door), mean_length=42.0))
    random = policy(stats(0, 10, 10, low=0.0, high=ZERO_OF_10_HIGH, mean_return=0.0, mean_length=0.0),
                    reach_v3=stats(0, 5, 5, low=0.0, high=0.5, mean_return=0.0, mean_length=0.0),
                    door_open_v3=stats(0, 5, 5, low=0.0, high=0.5, mean_return=0.0, mean_length=0.0))
    expert = policy(stats(0, 0, 10, low=0.0, high=1.0, mean_return=None, mean_length=None),
                    reach_v3=stats(0, 0, 5, low=0.0, high=1.0, mean_return=None, mean_length=None),
                    door_open_v3=stats(0, 0, 5, low=0.0, high=1.0, mean_return=None, mean_length=None))
    return {"policies": {"trained": trained, "random": random, "expert": expert}}


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mr.client(uri).get_metric_history(run_id, key))


def evaluate(uri: str, run_id: str, step: int | None, successes: tuple[int, int], *, outcome: str = "complete",
             why: str = "all shards reported", summary=None, artifacts=()) -> str:
    params = eval_params(EVAL, step=step, weights=f"/runs/x/checkpoints/step-{step}", tasks=TASKS)
    base = 1_700_000_000_000 + (step or 0) * 1000
    return log_evaluation(uri, run_id, step=step, results=results(successes), params=params, outcome=outcome,
                          why=why, summary=summary, artifacts=list(artifacts), start_ms=base, end_ms=base + 95_000)


def test_a_zero_success_rate_is_a_point_of_the_learning_curve(sqlite_uri):
    """0.0 is a result (the policy failed every episode), not a missing one: each evaluated step is a point of
    the training run's curve (the trained policy's, overall and per task; references, evaluated once, are in the
    description's table, not one-point charts). The child run keeps every zero too (rate, interval bound, mean
    return, mean length), and each policy's numbers."""
    run_id = mr.create_run(sqlite_uri, experiment="curve", run_name="train", status="RUNNING")
    children = {step: evaluate(sqlite_uri, run_id, step, successes)
                for step, successes in [(200, (0, 0)), (400, (1, 3)), (600, (0, 0))]}
    assert history(sqlite_uri, run_id, "eval/trained/success_rate") == [(200, 0.0), (400, 0.4), (600, 0.0)]
    low, high = wilson(4, 10)
    assert history(sqlite_uri, run_id, "eval/trained/success_ci_low") == [(200, 0.0), (400, low), (600, 0.0)]
    highs = history(sqlite_uri, run_id, "eval/trained/success_ci_high")
    assert [step for step, _ in highs] == [200, 400, 600]
    assert [value for _, value in highs] == pytest.approx([ZERO_OF_10_HIGH, high, ZERO_OF_10_HIGH], rel=1e-12)
    assert history(sqlite_uri, run_id, "eval/door-open-v3/success_rate") == [(200, 0.0), (400, 0.6), (600, 0.0)]
    assert history(sqlite_uri, run_id, "success_rate") == [(200, 0.0), (400, 0.4), (600, 0.0)]
    training = mr.find_run(sqlite_uri, run_id)["metrics"]
    assert set(training) == {*(f"eval/trained/{m}" for m in ("success_rate", "success_ci_low", "success_ci_high")),
                             *(f"eval/{task}/success_rate" for task in TASKS), "success_rate"}

    child = mr.latest_metrics(sqlite_uri, children[200])
    for name in ("trained", "trained/reach-v3", "trained/door-open-v3", "random", "random/reach-v3"):
        assert child[f"eval/{name}/success_rate"] == 0.0, name
        assert child[f"eval/{name}/success_ci_low"] == 0.0, name
        assert child[f"eval/{name}/episodes_missing"] == 0.0, name
    assert (child["eval/random/mean_return"], child["eval/random/mean_length"]) == (0.0, 0.0)
    assert child["eval/random/success_ci_high"] == ZERO_OF_10_HIGH
    assert child["eval/trained/reach-v3/mean_length"] == 38.0 and child["eval/trained/mean_return"] == 0.0
    assert child["eval/expert/episodes_missing"] == 10.0 and child["eval/expert/reach-v3/episodes_missing"] == 5.0
    assert not [key for key in child if key.startswith("eval/expert/") and not key.endswith("episodes_missing")]
    assert history(sqlite_uri, children[400], "eval/trained/door-open-v3/success_rate") == [(400, 0.6)]


def test_an_evaluation_without_a_step_adds_no_point(sqlite_uri):
    """`eval --ckpt` of an export: a child run at step 0, nothing on the training run's curve."""
    run_id = mr.create_run(sqlite_uri, experiment="curve", run_name="train", status="RUNNING")
    child = evaluate(sqlite_uri, run_id, None, (2, 2))
    assert mr.find_run(sqlite_uri, run_id)["metrics"] == {}
    assert history(sqlite_uri, child, "eval/trained/success_rate") == [(0, 0.4)]
    assert mr.find_run(sqlite_uri, child)["name"].startswith("step na eval ")


def test_the_child_run_carries_the_evaluation(tmp_path, sqlite_uri):
    """Parent, name, parameters, the evaluation's own times, the summary with its images linked into the child's
    artifacts, the plots; FINISHED when complete, FAILED with why when not."""
    run_id = mr.create_run(sqlite_uri, experiment="child", run_name="train", status="RUNNING")
    png = tmp_path / "task_success.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(64)))
    summary = tmp_path / "report.md"
    summary.write_text("# Evaluation\n\n![task success](plots/task_success.png)\n![ext](https://x.org/a.png)\n")
    done = evaluate(sqlite_uri, run_id, 400, (3, 5), summary=summary, artifacts=[(png, "plots")])
    why = "1 of 2 evaluation shards missing: [1]"
    failed = evaluate(sqlite_uri, run_id, 600, (2, 5), outcome="incomplete", why=why)

    child = mr.find_run(sqlite_uri, done)
    assert child["parent_run_id"] == run_id and child["status"] == "FINISHED"
    assert child["experiment_id"] == mr.find_run(sqlite_uri, run_id)["experiment_id"]
    assert (child["start_time"], child["end_time"]) == (1_700_000_400_000, 1_700_000_495_000)
    params = child["params"]
    assert (params["suite"], json.loads(params["tasks"]), params["seeds"]) == ("metaworld", TASKS, "[100]")
    assert (params["checkpoint_step"], params["weights"]) == ("400", "/runs/x/checkpoints/step-400")
    assert child["name"].startswith("step 400 eval ") and "embodyhpc.failure_reason" not in child["tags"]
    assert child["tags"]["embodyhpc.outcome"] == "complete"
    assert child["tags"]["mlflow.note.content"] == "Evaluation complete: all shards reported"
    client = mr.client(sqlite_uri)
    assert [f.path for f in client.list_artifacts(done, "plots")] == ["plots/task_success.png"]
    markdown = open(client.download_artifacts(done, "report.md", str(tmp_path / "down"))).read()
    assert markdown == ("# Evaluation\n\n"
                        f"![task success](get-artifact?path=plots%2Ftask_success.png&run_uuid={done})\n"
                        "![ext](https://x.org/a.png)\n")

    gone = mr.find_run(sqlite_uri, failed)
    assert gone["status"] == "FAILED" and gone["tags"]["embodyhpc.failure_reason"] == why
    assert gone["tags"]["mlflow.note.content"] == f"Evaluation incomplete: {why}"
    assert gone["name"].split()[-1] == child["name"].split()[-1]  # evaluated alike: one hash, one curve
    assert mr.find_run(sqlite_uri, run_id)["status"] == "RUNNING"  # the training run is the sink's to end
    assert history(sqlite_uri, run_id, "eval/trained/success_rate") == [(400, 0.8), (600, 0.7)]
    other = eval_params(SimpleNamespace(**{**EVAL.__dict__, "denoise_steps": 4}), step=400,
                        weights="/runs/x/checkpoints/step-400", tasks=TASKS)
    assert child_run_name(other) != child["name"] and child_run_name(other).startswith("step 400 eval ")


def test_the_report_backstop_keeps_an_ended_runs_reason(sqlite_uri):
    """The training sink ended the run FAILED with its own reason; the report's backstop (set_terminated with
    only_if_active) must leave the status, the reason and the description as they are. On a run nobody ended (a
    SIGKILLed job), the backstop ends it FAILED and says why."""
    ended = mr.create_run(sqlite_uri, experiment="backstop", run_name="train", description="trained on demos")
    sink = MlflowMetricsSink(sqlite_uri, ended, prefix="train/", flush_every=1, stream=io.StringIO())
    sink.write(10, {"loss": 1.0})
    sink.close("FAILED", reason="RuntimeError: CUDA out of memory\n  at step 10")
    before = mr.find_run(sqlite_uri, ended)
    assert before["status"] == "FAILED"
    assert before["tags"]["embodyhpc.failure_reason"] == "RuntimeError: CUDA out of memory at step 10"
    assert before["tags"]["mlflow.note.content"] == ("trained on demos\n\n**Failed:** RuntimeError: CUDA out of "
                                                     "memory at step 10")
    assert mr.set_terminated(sqlite_uri, ended, "FAILED", only_if_active=True,
                             reason="training did not finish") is False
    after = mr.find_run(sqlite_uri, ended)
    assert (after["status"], after["end_time"], after["tags"]) == (before["status"], before["end_time"],
                                                                   before["tags"])

    killed = mr.create_run(sqlite_uri, experiment="backstop", run_name="train2", description="trained on demos")
    sink = MlflowMetricsSink(sqlite_uri, killed, prefix="train/", flush_every=1, stream=io.StringIO())
    sink.write(10, {"loss": 1.0})  # RUNNING, then the job dies without closing the sink
    assert mr.set_terminated(sqlite_uri, killed, "FAILED", only_if_active=True,
                             reason="training did not finish:\n exit code 137") is True
    found = mr.find_run(sqlite_uri, killed)
    assert found["status"] == "FAILED"
    assert found["tags"]["embodyhpc.failure_reason"] == "training did not finish: exit code 137"
    assert found["tags"]["mlflow.note.content"] == ("trained on demos\n\n**Failed:** training did not finish: exit "
                                                    "code 137")
    finished = mr.create_run(sqlite_uri, experiment="backstop", run_name="train3")
    assert mr.set_terminated(sqlite_uri, finished, "FINISHED", reason="ignored: not a failure") is True
    assert "embodyhpc.failure_reason" not in mr.find_run(sqlite_uri, finished)["tags"]


def test_the_dataset_input_provenance_and_the_experiment_kind(sqlite_uri):
    """What submit logs besides params: the dataset as the run's input, MLflow's source tags, the run name that
    tells runs apart first, and the experiment kind that opens the runs table (a kind set by someone stays)."""
    from embodyhpc.tracking.provenance import log_dataset, source_tags

    mr.client(sqlite_uri).create_experiment("made-by-hand")  # no kind yet: gets one
    run_id = mr.create_run(sqlite_uri, experiment="made-by-hand", run_name=mr.run_display_name(
        "demo-metaworld-20261125-170417-2", "demo-metaworld"), tags=source_tags("recipes/demo_metaworld_cpu.yaml"))
    log_dataset(sqlite_uri, run_id, name="metaworld-mt4", path="/data/metaworld-mt4", num_episodes=98,
                fingerprint="ab" * 32, profile={"num_frames": 6855})
    client = mr.client(sqlite_uri)
    run = client.get_run(run_id)
    assert run.info.run_name == "170417-2 demo-metaworld 20261125"
    assert run.data.tags["mlflow.source.name"] == "embodyhpc submit recipes/demo_metaworld_cpu.yaml"
    assert run.data.tags["mlflow.source.type"] == "JOB"
    (dataset_input,) = run.inputs.dataset_inputs
    dataset = dataset_input.dataset
    assert (dataset.name, dataset.digest) == ("metaworld-mt4", ("ab" * 32)[:36])
    assert json.loads(dataset.source) == {"uri": "/data/metaworld-mt4"}
    assert json.loads(dataset.profile) == {"num_episodes": 98, "fingerprint": "ab" * 32, "num_frames": 6855}
    assert {t.key: t.value for t in dataset_input.tags} == {"mlflow.data.context": "training"}
    experiment = client.get_experiment_by_name("made-by-hand")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    client.set_experiment_tag(experiment.experiment_id, "mlflow.experimentKind", "genai_development")
    mr.create_run(sqlite_uri, experiment="made-by-hand", run_name="x")
    assert client.get_experiment_by_name("made-by-hand").tags["mlflow.experimentKind"] == "genai_development"


def test_telemetry_of_a_requeued_job_goes_on_after_its_last_step(sqlite_uri):
    """Per-node system metrics through metrics-only sinks: a requeued job's telemetry continues at next_step, and
    those sinks never change the run's status."""
    run_id = mr.create_run(sqlite_uri, experiment="telemetry", run_name="train", status="RUNNING")
    for node in (0, 1):
        sink = MlflowMetricsSink(sqlite_uri, run_id, prefix=f"system/node_{node}/", owns_status=False, flush_every=1)
        assert sink.next_step(f"system/node_{node}/") == 0
        for step in range(3 + node):
            sink.write(step, {"cpu_utilization_percentage": 10.0 * step})
        sink.close("FINISHED")
    again = MlflowMetricsSink(sqlite_uri, run_id, prefix="system/node_1/", owns_status=False, flush_every=1)
    assert (again.next_step("system/node_0/"), again.next_step("system/node_1/")) == (3, 4)
    again.write(again.next_step("system/node_1/"), {"cpu_utilization_percentage": 99.0})
    again.close()
    assert history(sqlite_uri, run_id, "system/node_1/cpu_utilization_percentage") == [
        (0, 0.0), (1, 10.0), (2, 20.0), (3, 30.0), (4, 99.0)]
    assert mr.find_run(sqlite_uri, run_id)["status"] == "RUNNING"


def test_markdown_links_hostile_paths():
    md = "![a](plots/x y.png) ![b](../../etc/passwd) ![c](/abs.png) ![d](data:image/png;base64,AAA) ![e](#top)"
    out = mlflow_markdown(md, "r1")
    assert "![b](get-artifact?path=..%2F..%2Fetc%2Fpasswd&run_uuid=r1)" in out  # the server refuses it, no file read
    assert "![c](/abs.png)" in out and "![d](data:image/png;base64,AAA)" in out and "![e](#top)" in out
    assert "![a](plots/x y.png)" in out  # not a markdown image link (a space): left as written
    assert mlflow_markdown("![x](p.png)", "a&b=c") == "![x](get-artifact?path=p.png&run_uuid=a%26b%3Dc)"
    assert mlflow_markdown("![x](p.png)", "r", prefix="eval/") == "![x](get-artifact?path=eval%2Fp.png&run_uuid=r)"
