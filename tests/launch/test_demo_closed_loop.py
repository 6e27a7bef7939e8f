"""The closed loop of `make demo`, through the CLI: expert demonstrations -> tiny pi0.5 on 2 processes (FSDP2 over
gloo) -> evaluations of checkpoints beside training -> evaluation array on held-out goals -> report; then
`embodyhpc eval --ckpt` on one of its checkpoints.

One run (tests/launch/demo.py, built once per test run) is read by every test here: the recipe as shipped but for
fewer evaluation episodes. The claim under test: the trained policy beats the random policy with non-overlapping
Wilson 95% intervals, on every run (the margin measured: trained 0.85 [0.71, 0.93] vs random 0.00 [0.00, 0.09]
at 40 episodes each).
"""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from embodyhpc.checkpoint import layout
from embodyhpc.rundir import requested_evals
from embodyhpc.runinfo import RunInfo
from tests.helpers import run_dir_from
from tests.launch.demo import PI05_EPISODES_PER_TASK, embodyhpc

pytestmark = [pytest.mark.slow, pytest.mark.sim, pytest.mark.xdist_group("pi05-demo")]
EPISODES = PI05_EPISODES_PER_TASK * 4  # 4 tasks, 1 seed


def _uri(run_dir) -> str:
    return f"sqlite:///{run_dir.parents[1] / 'mlflow.db'}"


def test_trained_policy_beats_random_with_non_overlapping_intervals(pi05_demo_run):
    run_dir = pi05_demo_run
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete", report["why"]
    overall = {name: p["overall"] for name, p in report["results"]["policies"].items()}
    assert set(overall) == {"trained", "expert", "random"}
    assert all(o["recorded"] == o["planned"] == EPISODES for o in overall.values())
    assert overall["trained"]["ci_low"] > overall["random"]["ci_high"], overall
    assert report["checkpoint_step"] == 600
    # the training run in MLflow: metrics from rank 0 and FINISHED; the report is its child run
    from embodyhpc.tracking.mlflow_run import find_run

    info = json.loads((run_dir / "run.json").read_text())
    uri = _uri(run_dir)
    parent = find_run(uri, info["mlflow_run_id"])
    assert parent["status"] == "FINISHED" and parent["metrics"]["train/loss"] > 0
    child = find_run(uri, report["mlflow_child_run_id"])
    assert child["parent_run_id"] == info["mlflow_run_id"]
    assert child["metrics"]["eval/trained/success_rate"] == overall["trained"]["success_rate"]
    # the export carries what evaluation needs to feed the policy as in training
    io = json.loads((run_dir / "export" / "policy_io.json").read_text())
    assert io == {"cameras": ["corner"], "image_size": 32, "state_key": "observation.environment_state",
                  "action_dim": 4, "fps": 80}
    assert json.loads((run_dir / "export" / "normalization.json").read_text())["mode"] == "mean_std"
    # ...and is the training run's logged model (tests/tracking/test_logged_model.py loads one and predicts)
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    [output] = client.get_run(info["mlflow_run_id"]).outputs.model_outputs
    logged = client.get_logged_model(output.model_id)
    assert logged.name == "policy" and logged.source_run_id == info["mlflow_run_id"]
    assert logged.tags["embodyhpc.export"] == str(run_dir / "export")


def _children(uri: str, parent_run_id: str) -> dict[str, dict]:
    from embodyhpc.tracking.mlflow_run import client, find_run

    runs = client(uri).search_runs(experiment_ids=[find_run(uri, parent_run_id)["experiment_id"]],
                                   filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return {run.info.run_name: find_run(uri, run.info.run_id) for run in runs}


def test_checkpoints_are_evaluated_beside_training(cli, pi05_demo_run):
    """The recipe evaluates every checkpoint short of the last (eval.every_k_checkpoints: 1, every 200 steps) while
    training goes on, each as an evaluation run of its own (export, eval, report) that pins its checkpoint against
    keep_latest_k: 2; the final evaluation is the chain's own."""
    run = pi05_demo_run
    final = json.loads((run / "eval" / "report.json").read_text())
    assert final["checkpoint_step"] == 600
    evals = requested_evals(run)
    assert [p.name for p in evals] == ["step-200", "step-400"]
    for path in evals:
        step = int(path.name.split("-")[1])
        info = RunInfo.load(path)
        assert {k: j.state for k, j in info.jobs.items()} == {"export": "COMPLETED", "eval": "COMPLETED",
                                                              "report": "COMPLETED"}, path
        report = json.loads((path / "eval" / "report.json").read_text())
        assert report["outcome"] == "complete" and report["checkpoint_step"] == step
        # evaluations while training run the trained policy only: reference rows do not change with the checkpoint
        assert report["eval"]["episodes_recorded"] == {"trained": EPISODES}
        assert (run / "exports" / path.name / "model.safetensors").is_file()
        assert sorted(p.name for p in (path / "scripts").iterdir()) == ["eval.sbatch", "export.sbatch",
                                                                         "report.sbatch"]
    # beside training: the training job asked for each evaluation while it ran (the evaluation run was made before
    # training wrote its result, whatever the machine's speed; the local backend runs them as they come)
    trained_at = (run / "logs" / "train_result.json").stat().st_mtime
    assert all(datetime.strptime(RunInfo.load(p).created, "%Y-%m-%dT%H:%M:%S%z").timestamp() <= trained_at
               for p in evals)
    assert not any(layout.pinned_by(run / "checkpoints" / f"step-{s}") for s in layout.list_steps(
        run / "checkpoints").complete)
    # one success-vs-step history for the run, with every evaluated step; MLflow children keyed by the step
    history = [json.loads(line) for line in (run / "eval" / "history.jsonl").read_text().splitlines()]
    assert sorted(h["step"] for h in history) == [200, 400, 600]
    assert not any((p / "eval" / "history.jsonl").exists() for p in evals)
    uri = _uri(run)
    # the chain's children share one settings hash (an `eval --ckpt` of the run, another test here, has its own)
    children = _children(uri, RunInfo.load(run).mlflow_run_id)
    [settings] = [name.rsplit(" ", 1)[1] for name, c in children.items() if c["run_id"] == final["mlflow_child_run_id"]]
    ours = {name: c for name, c in children.items() if name.endswith(f" eval {settings}")}
    assert sorted(name.rsplit(" ", 1)[0] for name in ours) == [f"step {s} eval" for s in (200, 400, 600)]
    assert {json.loads((p / "eval" / "report.json").read_text())["mlflow_child_run_id"] for p in evals} <= {
        c["run_id"] for c in ours.values()}
    from embodyhpc.tracking.mlflow_run import client

    points = set()
    for name, child in ours.items():
        history = client(uri).get_metric_history(child["run_id"], "eval/trained/success_rate")
        assert [m.step for m in history] == [int(name.split(" ")[1])]
        points.add((history[0].step, history[0].value))
    # the learning curve on the training run: a point at each step evaluated, the child's rate
    curve = client(uri).get_metric_history(RunInfo.load(run).mlflow_run_id, "eval/trained/success_rate")
    assert points <= {(m.step, m.value) for m in curve}
    text = cli("status", str(run)).out
    assert "evaluations while training:" in text
    assert "step-200: export COMPLETED, eval COMPLETED (2/2 done), report COMPLETED" in text
    assert set(json.loads(cli("status", str(run), "--json").out)["evals"]) == {"step-200", "step-400"}


def test_eval_ckpt_on_a_checkpoint_attaches_to_the_training_run(pi05_demo_run):
    run_dir = pi05_demo_run
    step = run_dir / "checkpoints" / "step-600"
    result = embodyhpc("eval", "--ckpt", str(step), "--local", "--json", "eval.reference_policies=[]",
                       "eval.episodes_per_task=2", "eval.shards=2", "eval.tasks=[button-press-topdown-v3]",
                       "eval.videos_per_task=0")
    eval_dir = run_dir_from(result.stdout)
    info = json.loads((eval_dir / "run.json").read_text())
    assert set(info["jobs"]) == {"export", "eval", "report"}  # no training job; the checkpoint is exported first
    assert [info["jobs"][k]["state"] for k in ("export", "eval", "report")] == ["COMPLETED"] * 3
    assert not (step / "pins").is_dir() or not any((step / "pins").iterdir())  # the export job unpinned it
    assert (run_dir / "exports" / "step-600" / "normalization.json").is_file()
    report = json.loads((eval_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete" and list(report["results"]["policies"]) == ["trained"]
    assert report["checkpoint_step"] == 600
    assert info["mlflow_run_id"] == json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    from embodyhpc.tracking.mlflow_run import find_run

    child = find_run(_uri(run_dir), report["mlflow_child_run_id"])
    assert child["parent_run_id"] == info["mlflow_run_id"]
