"""MlflowMetricsSink against a sqlite store: what lands in MLflow, statuses, failures never reaching training."""

from __future__ import annotations

import io
import math

import pytest

from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink
from embodyhpc.train.metrics import MetricsSink


@pytest.fixture
def run_id(sqlite_uri) -> str:
    return mr.create_run(sqlite_uri, experiment="e", run_name="train", params={}, tags={})


def _client(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _history(uri, run_id, key):
    return [(m.step, m.value) for m in _client(uri).get_metric_history(run_id, key)]


def test_three_steps_land_exactly(sqlite_uri, run_id):
    # flush by count only: the 30 s interval could pass during the first flush on a loaded machine
    sink: MetricsSink = MlflowMetricsSink(sqlite_uri, run_id, prefix="train/", flush_every=2, flush_interval_s=3600)
    steps = {10: {"loss": 2.5, "lr": 1e-3}, 20: {"loss": 1.25, "lr": 9e-4}, 30: {"loss": 0.625, "lr": 8e-4}}
    for step, metrics in steps.items():
        sink.write(step, metrics)
    assert mr.find_run(sqlite_uri, run_id)["status"] == "RUNNING"  # first flush (after 2 writes) marks it
    assert sink.pending == 2  # the third step waits for the next flush
    sink.close()
    assert _history(sqlite_uri, run_id, "train/loss") == [(s, m["loss"]) for s, m in steps.items()]
    assert _history(sqlite_uri, run_id, "train/lr") == [(s, m["lr"]) for s, m in steps.items()]
    found = mr.find_run(sqlite_uri, run_id)
    assert found["status"] == "FINISHED"
    assert set(found["metrics"]) == {"train/loss", "train/lr"}
    assert sink.sent == 6 and sink.pending == 0 and sink.dropped == 0


def test_nonfinite_values_skipped_and_counted(sqlite_uri, run_id):
    sink = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1)
    sink.write(1, {"loss": 1.0, "grad_norm": 3.0})
    sink.write(2, {"loss": math.nan, "grad_norm": math.inf})
    sink.write(3, {"loss": 0.5, "grad_norm": -math.inf, "note": "text"})
    sink.close()
    assert _history(sqlite_uri, run_id, "loss") == [(1, 1.0), (3, 0.5)]
    assert _history(sqlite_uri, run_id, "grad_norm") == [(1, 3.0)]
    assert _history(sqlite_uri, run_id, mr.NONFINITE_METRIC) == [(2, 2.0), (3, 2.0)]
    assert sink.nonfinite == 4


def test_close_status_follows_the_exception_in_flight(sqlite_uri):
    failed = mr.create_run(sqlite_uri, experiment="e", run_name="a", params={}, tags={})
    sink = MlflowMetricsSink(sqlite_uri, failed)
    with pytest.raises(ZeroDivisionError):
        try:
            sink.write(1, {"loss": 1.0})
            raise ZeroDivisionError
        finally:
            sink.close()  # what the training loop's `finally` does
    assert mr.find_run(sqlite_uri, failed)["status"] == "FAILED"
    assert _history(sqlite_uri, failed, "loss") == [(1, 1.0)]

    interrupted = mr.create_run(sqlite_uri, experiment="e", run_name="b", params={}, tags={})
    sink = MlflowMetricsSink(sqlite_uri, interrupted)
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt
        finally:
            sink.close()
    assert mr.find_run(sqlite_uri, interrupted)["status"] == "KILLED"


@pytest.mark.parametrize("status", ["KILLED", "FAILED", "RUNNING"])
def test_close_with_explicit_status(sqlite_uri, run_id, status):
    sink = MlflowMetricsSink(sqlite_uri, run_id)
    sink.write(1, {"loss": 1.0})
    sink.close(status)
    sink.close("FINISHED")  # a second close changes nothing
    found = mr.find_run(sqlite_uri, run_id)
    assert found["status"] == status  # RUNNING: left open for the requeued job
    assert found["metrics"] == {"loss": 1.0}


def test_resumed_job_logs_again_and_reopens_the_run(sqlite_uri, run_id):
    first = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1)
    for step in (1, 2, 3):
        first.write(step, {"loss": 1.0 / step})
    first.close("RUNNING")  # preempted after a checkpoint at step 2
    mr.set_terminated(sqlite_uri, run_id, "KILLED")  # e.g. the report of a cancelled chain
    second = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1)
    second.write(3, {"loss": 0.3})
    assert mr.find_run(sqlite_uri, run_id)["status"] == "RUNNING"
    second.close()
    assert _history(sqlite_uri, run_id, "loss") == [(1, 1.0), (2, 0.5), (3, 1.0 / 3), (3, 0.3)]
    assert mr.latest_metrics(sqlite_uri, run_id) == {"loss": 0.3}


class _FlakyClient:
    """Delegates to a real client; log_batch raises ConnectionError `fail` times first."""

    def __init__(self, real, fail: int) -> None:
        self.real, self.fail, self.calls = real, fail, 0

    def log_batch(self, *args, **kwargs):
        self.calls += 1
        if self.fail > 0:
            self.fail -= 1
            raise ConnectionError("connection refused")
        return self.real.log_batch(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_store_failure_warns_once_buffers_and_retries(sqlite_uri, run_id):
    err = io.StringIO()
    sink = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1, retry_interval_s=0, stream=err)
    flaky = _FlakyClient(_client(sqlite_uri), fail=3)
    sink._client = flaky
    for step in range(1, 7):
        sink.write(step, {"loss": float(step)})
    sink.close()
    assert flaky.calls == 3 + 3  # three refused, then steps 1-4 together, then 5 and 6
    assert _history(sqlite_uri, run_id, "loss") == [(s, float(s)) for s in range(1, 7)]
    lines = err.getvalue().splitlines()
    assert sum("unreachable" in line for line in lines) == 1, lines
    assert sum("reachable again" in line for line in lines) == 1, lines


def test_retry_waits_for_the_interval(sqlite_uri, run_id):
    sink = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1, retry_interval_s=3600, stream=io.StringIO())
    flaky = _FlakyClient(_client(sqlite_uri), fail=1)
    sink._client = flaky
    for step in range(1, 5):
        sink.write(step, {"loss": float(step)})
    assert flaky.calls == 1 and sink.pending == 4  # no retry within the hour
    sink.close()  # close tries once more regardless
    assert flaky.calls == 2 and sink.pending == 0
    assert len(_history(sqlite_uri, run_id, "loss")) == 4


def test_buffer_is_bounded(sqlite_uri, run_id):
    err = io.StringIO()
    sink = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1, max_buffered=5, retry_interval_s=3600, stream=err)
    sink._client = _FlakyClient(_client(sqlite_uri), fail=1)
    for step in range(1, 9):
        sink.write(step, {"loss": float(step)})
    assert sink.pending == 5 and sink.dropped == 3
    sink.close()
    assert _history(sqlite_uri, run_id, "loss") == [(s, float(s)) for s in range(4, 9)]  # the newest kept
    assert sum("dropping the oldest" in line for line in err.getvalue().splitlines()) == 1


def test_deleted_run_drops_values_without_raising(sqlite_uri, run_id):
    err = io.StringIO()
    _client(sqlite_uri).delete_run(run_id)
    sink = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1, stream=err)
    for step in range(1, 4):
        sink.write(step, {"loss": 1.0})
    sink.close()
    assert sink.pending == 0 and sink.dropped == 3 and sink.sent == 0
    assert err.getvalue().count("refused metrics") == 1


def test_missing_store_never_raises(tmp_path):
    err = io.StringIO()
    sink = MlflowMetricsSink(f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}", "0" * 32, flush_every=1, stream=err)
    sink.write(1, {"loss": 1.0})
    sink.close()
    assert sink.pending == 1
    assert "unreachable" in err.getvalue()
    assert not (tmp_path / "none").exists()


def test_time_based_flush(sqlite_uri, run_id):
    sink = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1000, flush_interval_s=0.0)
    sink.write(1, {"loss": 1.0})
    assert sink.pending == 0 and sink.sent == 1
    sink.close()


def test_a_metrics_only_sink_never_changes_the_run_status(sqlite_uri, run_id):
    """Telemetry from another node may arrive after rank 0 ended the run: it adds metrics, it does not reopen it."""
    owner = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1)
    owner.write(1, {"loss": 1.0})
    owner.close()
    assert mr.find_run(sqlite_uri, run_id)["status"] == "FINISHED"
    late = MlflowMetricsSink(sqlite_uri, run_id, flush_every=1, owns_status=False)
    late.write(7, {"sys/n2/cpu_pct": 50.0})
    late.close()
    found = mr.find_run(sqlite_uri, run_id)
    assert found["status"] == "FINISHED" and found["metrics"]["sys/n2/cpu_pct"] == 50.0
