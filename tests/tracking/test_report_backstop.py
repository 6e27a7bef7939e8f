"""The report job's MLflow backstop, through report_task on a run folder whose training failed (no server, no
training: the run folder as submit and a failed training leave it). The training run ends FAILED with why; a
reason the training sink already recorded is never overwritten by the report's."""

from __future__ import annotations

import io

import pytest

from embodyhpc.launch.report import report_task
from embodyhpc.runinfo import JobRecord
from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink
from tests.tracking.helpers import local_run_folder

RECIPE = "recipes/demo_metaworld_cpu.yaml"


def failed_run(runs_root, run_id: str):
    """A run folder whose training job failed (exit 1) before writing its result, with MLflow run `run_id`."""
    return local_run_folder(runs_root / "demo" / "run-1", RECIPE, [f"job.runs_root={runs_root}",
                            f"data.root={runs_root}"], mlflow_run_id=run_id,
                            jobs={"train": JobRecord("train", job_id="11", state="FAILED", exit_code=1),
                                  "eval": JobRecord("eval", job_id="12", state="CANCELLED"),
                                  "report": JobRecord("report", job_id="13", state="RUNNING")})


@pytest.mark.parametrize("sink_ended", [
    pytest.param(True, id="sink-ended-it"),
    # the report's plots cost ~0.6 s a call; set_terminated ending an active run is checked fast in test_eval_logging
    pytest.param(False, id="job-died-silently", marks=pytest.mark.slow)])
def test_the_report_ends_a_failed_training_run_without_overwriting_its_reason(sqlite_uri, sink_ended):
    runs_root = mr.sqlite_path(sqlite_uri).parent
    run_id = mr.create_run(sqlite_uri, experiment="demo", run_name="train", description="trained on demos")
    sink = MlflowMetricsSink(sqlite_uri, run_id, prefix="train/", flush_every=1, stream=io.StringIO())
    sink.write(10, {"loss": 1.0})
    if sink_ended:
        sink.close("FAILED", reason="RuntimeError: CUDA out of memory")
    run = failed_run(runs_root, run_id)
    report = report_task(str(run))
    assert report["outcome"] == "train_failed" and report["why"] == "training did not finish (state FAILED, exit 1)"
    found = mr.find_run(sqlite_uri, run_id)
    reason = "RuntimeError: CUDA out of memory" if sink_ended else "training did not finish (state FAILED, exit 1)"
    assert found["status"] == "FAILED"
    assert found["tags"]["embodyhpc.failure_reason"] == reason
    assert found["tags"]["mlflow.note.content"] == f"trained on demos\n\n**Failed:** {reason}"
    child = mr.find_run(sqlite_uri, report["mlflow_child_run_id"])
    assert child["parent_run_id"] == run_id and child["status"] == "FAILED"
    assert child["tags"]["embodyhpc.failure_reason"] == "training did not finish (state FAILED, exit 1)"
