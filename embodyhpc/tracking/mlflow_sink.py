"""The training loop's MLflow sink: buffered, bounded, and never an exception in training.

Rank 0 hands it each logged step (`embodyhpc.train.metrics.MetricsSink`). A slow or dead tracking server must not
stop or stall training, so:

- values are buffered and sent with `MlflowClient.log_batch` every `flush_every` writes or `flush_interval_s`
  seconds, whichever comes first (each value keeps the wall-clock time of its `write`);
- NaN/inf (and non-numbers) are not sent (MLflow's charts break on them); the number skipped at a step is logged
  as `<prefix>nonfinite_metrics` at that step, and logs/metrics.jsonl keeps them as null;
- HTTP requests retry once with a 15 s timeout (MLFLOW_HTTP_REQUEST_* set in the environment win);
- when the store cannot be reached, one line goes to stderr, values stay buffered (at most `max_buffered`; the
  oldest are dropped beyond, with one more line), and sending is retried on a later write no sooner than
  `retry_interval_s` after the failure; `close` tries once more and says how many values were never sent;
- errors that retrying cannot fix (the run was deleted, a value refused) drop the batch concerned, with one line.

After a requeue, steps between the last checkpoint and the interruption are logged again: MLflow keeps both values
in the history and shows the newest as the latest; logs/metrics.jsonl holds the curve without duplicates.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Mapping
from typing import TextIO

from embodyhpc.errors import mask_credentials
from embodyhpc.tracking.mlflow_run import (
    DESCRIPTION_TAG,
    MAX_METRICS_PER_BATCH,
    NONFINITE_METRIC,
    TERMINAL_STATUSES,
    bounded_http,
    client,
    finite_metrics,
    metric_key,
    record_failure,
)

SINK_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
_PERMANENT_ERRORS = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "INVALID_STATE", "PERMISSION_DENIED")


class MlflowMetricsSink:
    """Logs training metrics to the MLflow run `run_id` in the store `uri` (see the module docstring)."""

    def __init__(self, uri: str, run_id: str, *, prefix: str = "", flush_every: int = 10,
                 flush_interval_s: float = 30.0, max_buffered: int = 100_000, retry_interval_s: float = 60.0,
                 stream: TextIO | None = None, owns_status: bool = True) -> None:
        """owns_status=False: a sink that only adds metrics (per-node telemetry next to rank 0's sink) and never
        changes the run's status, so that a node finishing late cannot reopen a run rank 0 has ended."""
        if flush_every < 1 or max_buffered < 1:
            raise ValueError("flush_every and max_buffered must be at least 1")
        self.owns_status = owns_status
        self.uri = uri
        self.run_id = run_id
        self.prefix = prefix
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.max_buffered = max_buffered
        self.retry_interval_s = retry_interval_s
        self._stream = stream
        self._buffer: deque[tuple[str, float, int, int]] = deque()  # (key, value, timestamp ms, step)
        self._client = None
        self._marked_running = False
        self._writes_since_flush = 0
        self._last_flush = time.monotonic()
        self._retry_at = 0.0
        self._failing = False
        self._warned_drop = False
        self._warned_permanent = False
        self._closed = False
        self.sent = 0
        """Values MLflow accepted."""
        self.dropped = 0
        """Values given up on: buffer overflow or errors that retrying cannot fix."""
        self.nonfinite = 0
        """Values skipped because they were NaN/inf or not numbers."""

    @property
    def pending(self) -> int:
        """Values buffered and not yet sent."""
        return len(self._buffer)

    # ---- MetricsSink ----
    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        try:
            self._add(step, metrics)
            self._writes_since_flush += 1
            now = time.monotonic()
            due = (self._writes_since_flush >= self.flush_every
                   or now - self._last_flush >= self.flush_interval_s)
            if due and now >= self._retry_at:
                self.flush()
        except Exception as exc:  # never into training
            self._say(f"MLflow metrics sink error ignored: {exc!r}")

    def next_step(self, prefix: str) -> int:
        """One past the largest step logged under keys starting with `prefix` (0 when none, or when the store
        cannot be read): where a requeued job's telemetry continues. One bounded request; never raises."""
        try:
            mlflow_client = self._connect()
            if mlflow_client is None:
                return 0
            with bounded_http(SINK_HTTP_ENV):
                keys = [key for key in mlflow_client.get_run(self.run_id).data.metrics if key.startswith(prefix)]
                if not keys:
                    return 0
                return 1 + max(m.step for m in mlflow_client.get_metric_history(self.run_id, min(keys)))
        except Exception as exc:  # noqa: BLE001 - a fresh count is the fallback, not an error
            self._say(f"MLflow run {self.run_id}: could not read the last step of {prefix}* ({_short(exc)}); "
                      "counting from 0")
            return 0

    def close(self, status: str | None = None, *, reason: str | None = None) -> None:
        """Send what is buffered (one attempt), then end the run.

        `status`: FINISHED, FAILED or KILLED; RUNNING leaves the run open (a job about to be requeued). None (what
        the training loop's `finally` passes): FAILED when an exception is propagating, KILLED for
        KeyboardInterrupt/SystemExit, else FINISHED. `reason`: why a FAILED/KILLED run ended (its failure reason).
        """
        if self._closed:
            return
        self._closed = True
        try:
            status = self._final_status(status)
            self.flush(force=True)
            if self._buffer:
                self._say(f"{len(self._buffer)} metric values were not sent to MLflow at {self.uri} "
                          "(logs/metrics.jsonl has them)")
            if self.owns_status and status in TERMINAL_STATUSES and self._connect() is not None:
                with bounded_http(SINK_HTTP_ENV):
                    if reason and status != "FINISHED":
                        description = self._client.get_run(self.run_id).data.tags.get(DESCRIPTION_TAG)
                        record_failure(self._client, self.run_id, reason, description)
                    self._client.set_terminated(self.run_id, status)
        except Exception as exc:
            self._say(f"could not end MLflow run {self.run_id} at {self.uri}: {_short(exc)}")

    # ---- sending ----
    def flush(self, *, force: bool = False) -> bool:
        """Send buffered values now (unless waiting to retry; `force` ignores that). True when nothing is left."""
        self._writes_since_flush = 0
        self._last_flush = time.monotonic()
        if not self._buffer:
            return True
        if not force and time.monotonic() < self._retry_at:
            return False
        try:
            from mlflow.entities import Metric

            mlflow_client = self._connect()
            if mlflow_client is None:
                return False
            with bounded_http(SINK_HTTP_ENV):
                if not self._marked_running and self.owns_status:
                    mlflow_client.update_run(self.run_id, status="RUNNING")
                    self._marked_running = True
                while self._buffer:
                    chunk = [self._buffer[i] for i in range(min(MAX_METRICS_PER_BATCH, len(self._buffer)))]
                    try:
                        mlflow_client.log_batch(self.run_id, metrics=[Metric(*item) for item in chunk],
                                                synchronous=True)
                    except Exception as exc:
                        if getattr(exc, "error_code", None) not in _PERMANENT_ERRORS:
                            raise
                        self._drop_front(len(chunk))
                        self._permanent(exc)
                        continue
                    self._drop_front(len(chunk), sent=True)
        except Exception as exc:
            if getattr(exc, "error_code", None) in _PERMANENT_ERRORS:  # from update_run: the run is gone
                self.dropped += len(self._buffer)
                self._buffer.clear()
                self._permanent(exc)
                return True
            self._failed(exc)
            return False
        if self._failing:
            self._failing = False
            self._say(f"MLflow at {self.uri} reachable again; buffered metrics sent")
        return True

    def _connect(self):
        if self._client is None:
            try:
                self._client = client(self.uri)
            except Exception as exc:
                self._failed(exc)
                return None
        return self._client

    def _add(self, step: int, metrics: Mapping[str, float]) -> None:
        values, skipped = finite_metrics({f"{self.prefix}{key}": value for key, value in metrics.items()})
        if skipped:
            self.nonfinite += skipped
            values[metric_key(f"{self.prefix}{NONFINITE_METRIC}")] = float(skipped)
        stamp = int(time.time() * 1000)
        for key, value in values.items():
            self._buffer.append((key, value, stamp, int(step)))
        overflow = len(self._buffer) - self.max_buffered
        if overflow > 0:
            self._drop_front(overflow)
            if not self._warned_drop:
                self._warned_drop = True
                self._say(f"MLflow buffer full ({self.max_buffered} values): dropping the oldest")

    def _drop_front(self, count: int, *, sent: bool = False) -> None:
        for _ in range(count):
            self._buffer.popleft()
        if sent:
            self.sent += count
        else:
            self.dropped += count

    def _failed(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + self.retry_interval_s
        if not self._failing:
            self._failing = True
            self._say(f"MLflow at {self.uri} unreachable ({_short(exc)}); training goes on, metrics are buffered "
                      f"and sent again every {self.retry_interval_s:g} s")

    def _permanent(self, exc: BaseException) -> None:
        if not self._warned_permanent:
            self._warned_permanent = True
            self._say(f"MLflow refused metrics for run {self.run_id} ({_short(exc)}); those values are dropped")

    def _final_status(self, status: str | None) -> str:
        if status is not None:
            if status in (*TERMINAL_STATUSES, "RUNNING"):
                return status
            self._say(f"unknown MLflow run status {status!r} ignored")
        exc = sys.exc_info()[1]
        if exc is None:
            return "FINISHED"
        return "FAILED" if isinstance(exc, Exception) else "KILLED"

    def _say(self, message: str) -> None:
        stream = self._stream if self._stream is not None else sys.stderr
        try:
            print(f"embodyhpc: {mask_credentials(message)}", file=stream, flush=True)  # the store's URI too
        except Exception:  # a closed stream must not matter either
            pass


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."

