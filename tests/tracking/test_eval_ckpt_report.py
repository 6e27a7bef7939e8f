"""The report job of an `eval --ckpt` run folder (export, eval and report jobs; no training) on a real sqlite store:
its child run is an ad-hoc record of the training run, whose curve, result and history stay as they were."""

from __future__ import annotations

import json

import pytest

from embodyhpc.launch.report import report_task
from embodyhpc.rundir import HISTORY_FILE, shard_file
from embodyhpc.runinfo import JobRecord
from embodyhpc.tracking import mlflow_run as mr
from tests.tracking.helpers import local_run_folder

RECIPE = "recipes/demo_metaworld_cpu.yaml"


@pytest.mark.slow  # 1.3-2.7 s (the report's plots); the logging claim is fast in test_eval_ckpt_record
def test_an_eval_ckpt_report_is_its_own_record(sqlite_uri):
    runs_root = mr.sqlite_path(sqlite_uri).parent
    training = mr.create_run(sqlite_uri, experiment="demo", run_name="train", status="RUNNING")
    mr.log_step_metrics(mr.client(sqlite_uri), training, {"eval/trained/success_rate": 0.9}, 400)
    weights = runs_root / "demo" / "train-1" / "exports" / "step-400"
    run = local_run_folder(runs_root / "demo" / "eval-1", RECIPE, [
        f"job.runs_root={runs_root}", f"data.root={runs_root}", f"eval.weights={weights}", "eval.reference_policies=[]",
        "eval.tasks=[reach-v3]", "eval.episodes_per_task=2", "eval.shards=1"], mlflow_run_id=training,
        jobs={"eval": JobRecord("eval", job_id="12", state="COMPLETED", exit_code=0),
              "report": JobRecord("report", job_id="13", state="RUNNING")})
    shard = shard_file(run, "trained", 0)
    shard.parent.mkdir(parents=True)
    shard.write_text("".join(json.dumps({"policy": "trained", "task": "reach-v3", "seed": 100, "episode": e,
                                         "success": True, "checkpoint_step": 400}) + "\n" for e in range(2)))
    report = report_task(str(run))
    assert report["outcome"] == "complete", report["why"]
    assert [(m.step, m.value) for m in mr.client(sqlite_uri).get_metric_history(
        training, "eval/trained/success_rate")] == [(400, 0.9)]  # 2/2 of the ad-hoc run added nothing
    found = mr.find_run(sqlite_uri, training)
    assert "success" not in found["tags"] and set(found["metrics"]) == {"eval/trained/success_rate"}
    child = mr.find_run(sqlite_uri, report["mlflow_child_run_id"])
    assert child["parent_run_id"] == training and child["name"].startswith("ckpt-eval step 400 2ep x1 tasks ")
    assert child["tags"]["embodyhpc.evaluation"] == "ad-hoc" and child["tags"]["embodyhpc.weights"] == str(weights)
    assert any(key.startswith("embodyhpc.eval_ckpt/step-400/") for key in found["tags"])
    assert not (weights.parent.parent / HISTORY_FILE).exists()  # the training run's history is not touched
