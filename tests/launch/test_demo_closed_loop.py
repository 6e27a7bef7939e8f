"""The closed loop of `make demo`, through the CLI: expert demonstrations -> tiny pi0.5 on 2 processes (FSDP2 over
gloo) -> evaluation array on held-out goals -> report; then `embodyhpc eval --ckpt` on one of its checkpoints.

Smaller than the demo where it does not change the question (fewer demonstrations and evaluation episodes), the
same recipe otherwise. The claim under test: the trained policy beats the random policy with non-overlapping
Wilson 95% intervals, on every run (the margin measured: trained 0.85 [0.71, 0.93] vs random 0.00 [0.00, 0.09]
at 40 episodes each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import run_dir_from

DEMO = "recipes/demo_metaworld_cpu.yaml"
TASKS = "reach-v3,button-press-topdown-v3,drawer-open-v3,door-open-v3"

pytestmark = pytest.mark.slow


def embodyhpc(*args: str) -> subprocess.CompletedProcess:
    """The installed command line in its own process, as `make demo` runs it."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    result = subprocess.run([sys.executable, "-m", "embodyhpc.cli.main", *args], capture_output=True, text=True,
                            env=env, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    data = root / "demos"
    embodyhpc("data", "synth", "--out", str(data), "--tasks", TASKS, "--episodes", "20", "--image-size", "32",
              "--workers", "2")
    result = embodyhpc("submit", DEMO, "--local", "--json", f"job.runs_root={root / 'runs'}", f"data.root={data}",
                       "eval.episodes_per_task=6", "eval.shards=2")
    return run_dir_from(result.stdout), root


def test_trained_policy_beats_random_with_non_overlapping_intervals(demo_run):
    run_dir, _ = demo_run
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete", report["why"]
    overall = {name: p["overall"] for name, p in report["results"]["policies"].items()}
    assert set(overall) == {"trained", "expert", "random"}
    assert all(o["recorded"] == o["planned"] == 24 for o in overall.values())
    assert overall["trained"]["ci_low"] > overall["random"]["ci_high"], overall
    assert report["checkpoint_step"] == 600
    # the training run in MLflow: metrics from rank 0 and FINISHED; the report is its child run
    from embodyhpc.tracking.mlflow_run import find_run

    info = json.loads((run_dir / "run.json").read_text())
    uri = f"sqlite:///{run_dir.parents[1] / 'mlflow.db'}"
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


def test_eval_ckpt_on_a_checkpoint_attaches_to_the_training_run(demo_run):
    run_dir, _ = demo_run
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

    child = find_run(f"sqlite:///{run_dir.parents[1] / 'mlflow.db'}", report["mlflow_child_run_id"])
    assert child["parent_run_id"] == info["mlflow_run_id"]
