"""Over HTTP: a real `mlflow server` (tests/conftest.py `mlflow_server`), and a server that is not there."""

from __future__ import annotations

import io
import os

import pytest

from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink
from tests.tracking.helpers import check_child_run, child_run_in_subprocess, report_files


@pytest.mark.slow  # the server takes 9-30 s to answer /health on a shared machine
def test_sink_child_run_and_artifacts_over_http(tmp_path, mlflow_server):
    uri = mlflow_server
    mr.init_store(uri)  # no-op for a server
    run_id = mr.create_run(uri, experiment="http-e2e", run_name="train", params={"train": {"steps": 30}},
                           tags={"embodyhpc.backend": "local"})
    assert mr.find_run(uri, run_id)["status"] == "SCHEDULED"
    sink = MlflowMetricsSink(uri, run_id, prefix="train/", flush_every=2)
    for step in (10, 20, 30):
        sink.write(step, {"loss": 3.0 / step, "lr": 1e-3})
    sink.close()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")] == \
        [(10, 0.3), (20, 0.15), (30, 0.1)]
    found = mr.find_run(uri, run_id)
    assert found["status"] == "FINISHED"
    assert found["params"] == {"train.steps": "30"}
    assert found["experiment"] == "http-e2e"

    plot, videos = report_files(tmp_path)
    out = child_run_in_subprocess(uri, run_id, 30, plot, videos)
    check_child_run(uri, run_id, out["run_id"], 30)
    experiment_id = mr.find_run(uri, run_id)["experiment_id"]
    assert mr.ui_hint(uri, run_id) == f"{uri}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def test_unreachable_server_never_raises_and_warns_once(monkeypatch, unreachable):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    err = io.StringIO()
    sink = MlflowMetricsSink(unreachable.uri, "0" * 32, flush_every=1, retry_interval_s=0, stream=err)
    for step in range(1, 21):  # every write retries: the worst case
        sink.write(step, {"loss": 1.0, "lr": 0.1})
    sink.close()
    assert unreachable.connects <= 2 * 21 and unreachable.backoff_s == 0  # no retries: a try or two per flush, no waits
    assert sink.pending == 40 and sink.sent == 0
    lines = err.getvalue().splitlines()
    assert sum("unreachable" in line for line in lines) == 1, lines
    assert any("40 metric values were not sent" in line for line in lines), lines


def test_unreachable_server_bounded_by_the_sinks_own_defaults(monkeypatch, unreachable):
    """No MLFLOW_HTTP_REQUEST_* set: MLflow alone would retry 7 times with backoff (minutes); the sink does not."""
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    err = io.StringIO()
    sink = MlflowMetricsSink(unreachable.uri, "0" * 32, flush_every=1, stream=err)
    for step in range(1, 101):
        sink.write(step, {"loss": 1.0})
    sink.close("FAILED")
    # 100 writes, yet a handful of connections and no back-off: the sink stops trying for a while after a failure
    assert unreachable.connects <= 10 and unreachable.backoff_s < 10, vars(unreachable)
    assert sink.pending == 100
    assert err.getvalue().count("unreachable") == 1
    assert "MLFLOW_HTTP_REQUEST_MAX_RETRIES" not in os.environ  # the bounds were scoped to the sink's calls


def test_cli_helpers_fail_fast_with_a_tracking_error(monkeypatch, unreachable):
    monkeypatch.delenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", raising=False)
    with pytest.raises(mr.TrackingError, match="could not create"):
        mr.create_run(unreachable.uri, experiment="e", run_name="r", params={}, tags={})
    with pytest.raises(mr.TrackingError):
        mr.find_run(unreachable.uri, "0" * 32)
    # two calls, each a few tries with seconds of back-off between them, not MLflow's 8 tries and minutes
    assert unreachable.connects <= 8 and unreachable.backoff_s < 10, vars(unreachable)
