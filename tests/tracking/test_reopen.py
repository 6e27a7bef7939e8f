"""reopen_run: the run `embodyhpc resume` continues is SCHEDULED again, and the training values after the checkpoint
step (logged by an attempt killed before a checkpoint held them) leave a sqlite store; a server reports them."""

from __future__ import annotations

import time

import pytest

from embodyhpc.tracking.mlflow_run import TrackingError, client, create_run
from embodyhpc.tracking.reopen import reopen_run


def _log(uri: str, run_id: str, key: str, steps: range, offset: float = 0.0) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    client(uri).log_batch(run_id, metrics=[Metric(key, step + offset, now + step, step) for step in steps])


def _run(uri: str) -> str:
    run_id = create_run(uri, experiment="e", run_name="r")
    for key in ("train/loss", "train/lr"):
        _log(uri, run_id, key, range(1, 11))
    _log(uri, run_id, "sys/n1/cpu_percent", range(0, 20))  # telemetry counts its own ticks: never touched
    client(uri).set_terminated(run_id, "KILLED")
    return run_id


def test_values_after_the_checkpoint_leave_a_sqlite_store_and_the_latest_value_follows(sqlite_uri):
    run_id = _run(sqlite_uri)
    reopened = reopen_run(sqlite_uri, run_id, after_step=6)
    assert (reopened.previous_status, reopened.removed, reopened.kept_steps) == ("KILLED", 8, [])
    mlflow = client(sqlite_uri)
    assert [m.step for m in mlflow.get_metric_history(run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert len(mlflow.get_metric_history(run_id, "sys/n1/cpu_percent")) == 20
    run = mlflow.get_run(run_id)
    assert run.info.status == "SCHEDULED"
    assert run.data.metrics["train/loss"] == 6.0 and run.data.metrics["sys/n1/cpu_percent"] == 19.0
    # the resumed attempt logs steps 7.. again: one value per step
    _log(sqlite_uri, run_id, "train/loss", range(7, 13), offset=0.5)
    history = mlflow.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 13))
    assert mlflow.get_run(run_id).data.metrics["train/loss"] == 12.5


def test_nothing_after_the_step_and_no_step_change_nothing_but_the_status(sqlite_uri):
    run_id = _run(sqlite_uri)
    assert reopen_run(sqlite_uri, run_id, after_step=10).removed == 0
    assert reopen_run(sqlite_uri, run_id).removed == 0
    assert len(client(sqlite_uri).get_metric_history(run_id, "train/loss")) == 10


def test_unknown_and_deleted_runs_are_errors(sqlite_uri):
    with pytest.raises(TrackingError, match="could not reopen"):
        reopen_run(sqlite_uri, "0" * 32)
    run_id = _run(sqlite_uri)
    client(sqlite_uri).delete_run(run_id)
    with pytest.raises(TrackingError, match="deleted"):
        reopen_run(sqlite_uri, run_id, after_step=3)


@pytest.mark.slow
def test_a_server_keeps_them_and_says_which(mlflow_server):
    run_id = _run(mlflow_server)
    reopened = reopen_run(mlflow_server, run_id, after_step=6)
    assert (reopened.removed, reopened.kept_steps) == (0, [7, 8, 9, 10])
    assert client(mlflow_server).get_run(run_id).info.status == "SCHEDULED"
