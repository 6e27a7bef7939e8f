"""Continuing a training run's MLflow run after `embodyhpc resume`: the same run id, SCHEDULED again, and one value
per step (what an attempt killed between two checkpoints logged past the last one leaves a sqlite store)."""

from __future__ import annotations

import dataclasses

from embodyhpc.tracking.mlflow_run import (
    CLI_HTTP_ENV,
    TrackingError,
    _default_artifact_location,
    bounded_http,
    client,
    sqlite_path,
)
from embodyhpc.tracking.mlflow_values import one_line


@dataclasses.dataclass(frozen=True)
class Reopened:
    """What `reopen_run` found and did."""

    previous_status: str
    removed: int
    """Values after `after_step` dropped from the store (sqlite)."""
    kept_steps: list[int]
    """Steps after `after_step` a server still holds (MLflow has no call that deletes a value)."""


def reopen_run(uri: str, run_id: str, *, after_step: int | None = None, prefix: str = "train/") -> Reopened:
    """`embodyhpc resume`: the run `run_id` goes on (the same id, one curve), so it is SCHEDULED again whatever it
    ended as (KILLED by a cancel, FAILED, FINISHED before more steps); the training sink marks it RUNNING.

    `after_step`: the checkpoint step the new attempt starts from. Values of keys under `prefix` at later steps were
    logged by an attempt that died before a checkpoint held them (a SIGKILL after a cancel's grace period, an OOM, a
    node failure); the new attempt logs those steps again. A sqlite store drops them, so each step has one value;
    an MLflow server cannot (no API deletes a value), so the steps it keeps are returned for the caller to report.
    TrackingError when the store cannot be reached or holds no such run (deleted runs too)."""
    with bounded_http(CLI_HTTP_ENV):
        try:
            mlflow_client = client(uri)
            run = mlflow_client.get_run(run_id)
            if run.info.lifecycle_stage != "active":
                raise TrackingError(f"MLflow run {run_id} in {uri} was deleted")
            removed, kept = 0, []
            if after_step is not None:
                if sqlite_path(uri) is not None:
                    removed = _drop_values_after(uri, run_id, after_step, prefix)
                else:
                    keys = [key for key in run.data.metrics if key.startswith(prefix)]
                    kept = sorted({m.step for key in keys[:1] for m in mlflow_client.get_metric_history(run_id, key)
                                   if m.step > after_step})
            mlflow_client.update_run(run_id, status="SCHEDULED")
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"could not reopen MLflow run {run_id} in {uri}: {one_line(exc)}") from exc
    return Reopened(run.info.status, removed, kept)


def _drop_values_after(uri: str, run_id: str, step: int, prefix: str) -> int:
    """Delete the run's values of keys under `prefix` at steps after `step` from a sqlite store, and point each
    key's latest value back at what is left (MLflow's rule: highest step, then timestamp, then value). Through
    MLflow's own ORM models (tests/tracking/test_reopen.py pins them)."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    pattern = prefix.replace("%", r"\%").replace("_", r"\_") + "%"
    store = SqlAlchemyStore(uri, _default_artifact_location(uri))
    with store.ManagedSessionMaker(read_only=False) as session:
        removed = session.query(SqlMetric).filter(
            SqlMetric.run_uuid == run_id, SqlMetric.step > step, SqlMetric.key.like(pattern, escape="\\")
        ).delete(synchronize_session=False)
        stale = session.query(SqlLatestMetric).filter(
            SqlLatestMetric.run_uuid == run_id, SqlLatestMetric.step > step,
            SqlLatestMetric.key.like(pattern, escape="\\")).all()
        for latest in stale:
            same_key = session.query(SqlMetric).filter(SqlMetric.run_uuid == run_id, SqlMetric.key == latest.key)
            newest = same_key.order_by(SqlMetric.step.desc(), SqlMetric.timestamp.desc(),
                                       SqlMetric.value.desc()).first()
            if newest is None:
                session.delete(latest)
            else:
                latest.value, latest.timestamp, latest.step, latest.is_nan = (
                    newest.value, newest.timestamp, newest.step, newest.is_nan)
    return int(removed)
