"""MLflow for embodyhpc: the store, the training run, the report's child run, and reading them back.

One MLflow run per `embodyhpc submit`, created by the CLI before any job starts; its id goes into run.json
(`RunInfo.mlflow_run_id`) and every job of the chain continues that run. Statuses, as the MLflow UI shows them:

    submit (CLI)        init_store(uri); create_run(...)                    -> SCHEDULED (queued, not started)
    train, rank 0       MlflowMetricsSink: first contact with the store     -> RUNNING
                        sink.close() at the end of training                 -> FINISHED, or FAILED / KILLED when an
                                                                               exception is propagating (see close)
    requeue/resume      the new job's sink marks it RUNNING again; metrics of the steps after the checkpoint are
                        logged a second time (MLflow keeps every value: the history shows both, "latest" is the
                        newest) -- logs/metrics.jsonl is the curve without duplicates
    report job          embodyhpc.tracking.evaluation: the headline on the training run at the checkpoint step and a
                        nested run (log_child_run) with every statistic, plots, videos and the summary;
                        set_terminated(..., "FAILED", only_if_active=True, reason=...) closes a training run whose
                        job died without closing it (OOM, SIGKILL, node failure)

MLflow run start_time is the submit time, so the UI's duration includes the queue wait.

Stores: the default is a sqlite file under the runs root (`tracking_uri`), with artifacts next to it
(`artifact_root`) set explicitly on the experiment (MLflow's defaults land in the working directory). A fresh
sqlite file must be created by one process only (two at once crash in MLflow's schema migration): `init_store` runs
at submit time and is serialized by a file lock. http(s) URIs name a tracking server run by the site; there the
server owns schema and artifact storage.

mlflow is imported inside functions only: `embodyhpc --help` and `render` never load it. HTTP calls made from here
retry at most 2 times (MLflow's default of 7 with exponential backoff waits ~4 minutes for a dead server); the
training sink is stricter still (see `embodyhpc.tracking.mlflow_sink`). MLFLOW_HTTP_REQUEST_* variables set in the
environment take precedence.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shlex
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlparse

from embodyhpc.config.credentials import without_credentials
from embodyhpc.errors import RunFailure, mask_credentials
from embodyhpc.tracking.mlflow_values import (  # noqa: F401 - re-exported: callers name them from here
    MAX_KEY_LENGTH,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VALUE_LENGTH,
    MAX_PARAMS_PER_BATCH,
    MAX_TAG_VALUE_LENGTH,
    NONFINITE_METRIC,
    REDACTED,
    finite_metrics,
    flatten_params,
    metric_key,
    one_line,
    tags_of,
    truncate,
)

if TYPE_CHECKING:
    from embodyhpc.config.schema import TrackingConfig

DB_FILE = "mlflow.db"
ARTIFACT_DIR = "mlartifacts"
PARENT_TAG = "mlflow.parentRunId"
DESCRIPTION_TAG = "mlflow.note.content"
"""The run's description (MLflow shows it as the run page's Description)."""
FAILURE_TAG = "embodyhpc.failure_reason"
"""Why a run ended FAILED, on one line (MLflow has no field for it; also appended to the description)."""
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_DEVELOPMENT = "custom_model_development"
"""The experiment kind (values: the MLflow UI's ExperimentKind) that opens an experiment on its runs table."""
TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")
ACTIVE_STATUSES = ("SCHEDULED", "RUNNING")

CLI_HTTP_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
"""Bounds for calls a user waits on (submit, status, the report job); variables already set win."""

_initialized: set[str] = set()
_env_lock = threading.RLock()


class TrackingError(RunFailure):
    """The MLflow store could not be reached or refused a request (runtime failure, exit code 1)."""


# ---- where things go ----
def tracking_uri(tracking: TrackingConfig, runs_root: str | os.PathLike[str]) -> str:
    """`tracking.mlflow_uri` when set, else a sqlite file `<runs_root>/mlflow.db` (absolute)."""
    if tracking.mlflow_uri:
        return tracking.mlflow_uri
    return "sqlite:///" + str(Path(runs_root).expanduser().resolve() / DB_FILE)


def artifact_root(runs_root: str | os.PathLike[str]) -> str:
    """Absolute `<runs_root>/mlartifacts`: the artifact location of experiments in the default sqlite store."""
    return str(Path(runs_root).expanduser().resolve() / ARTIFACT_DIR)


def is_http(uri: str) -> bool:
    return urlparse(uri).scheme in ("http", "https")


def sqlite_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///path` URI (None for other stores and in-memory databases)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///"):].split("?", 1)[0]
    if not path or path == ":memory:":
        return None
    return Path(path).expanduser().resolve()


def init_lock_path(uri: str) -> Path | None:
    """The file lock `init_store` holds while it creates or upgrades a sqlite database (None: not sqlite)."""
    db = sqlite_path(uri)
    return None if db is None else db.with_name(db.name + ".lock")


def _default_artifact_location(uri: str) -> str | None:
    db = sqlite_path(uri)
    return None if db is None else str(db.parent / ARTIFACT_DIR)


# ---- run names ----
_STAMP = re.compile(r"^(?P<name>.*)-(?P<date>\d{8})-(?P<time>\d{6})(?P<n>-\d+)?$")


def run_display_name(run_dir_name: str, job_name: str) -> str:
    """The MLflow run name of a run folder `<job.name>-<YYYYMMDD>-<HHMMSS>[-n]`: what tells runs apart first
    (the time, then the name, then the date), because the runs table cuts names to a common prefix:
    "170417 demo-metaworld 20261125". A folder named otherwise keeps its name."""
    found = _STAMP.match(run_dir_name)
    if found is None:
        return run_dir_name
    return f"{found['time']}{found['n'] or ''} {found['name'] or job_name} {found['date']}"


# ---- the store ----
def init_store(uri: str) -> None:
    """Create or upgrade a sqlite store's schema; safe when several processes call it at once. Other URIs: no-op.

    Run it at submit time, before jobs fan out. Repeated calls in one process are free; across processes a call
    on an up-to-date database costs ~0.1 s.
    """
    db = sqlite_path(uri)
    if db is None or uri in _initialized:
        return
    try:
        # Imports first (seconds): the locked section then holds only the database work.
        from mlflow.db import upgrade  # the `mlflow db upgrade URI` command: creates a fresh database too
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        db.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(init_lock_path(uri)), _quiet_loggers("mlflow.store.db.utils", "alembic"):
            upgrade.main([uri], standalone_mode=False)
            # Opening the store once creates the Default experiment with its artifacts beside the database
            # (instead of the working directory of whoever opens it first).
            SqlAlchemyStore(uri, _default_artifact_location(uri))
    except Exception as exc:
        raise TrackingError(f"could not initialise the MLflow store {uri}: {one_line(exc)}") from exc
    _initialized.add(uri)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as exc:  # some parallel filesystems are mounted without flock support
            print(f"embodyhpc: cannot lock {path} ({exc}); initialising the MLflow store without a lock",
                  file=sys.stderr)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_loggers(*names: str) -> Iterator[None]:
    import logging

    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def bounded_http(defaults: Mapping[str, str]) -> Iterator[None]:
    """MLflow reads MLFLOW_HTTP_REQUEST_* at each request: set `defaults` (those not already set) for the block."""
    with _env_lock:
        added = [key for key in defaults if key not in os.environ]
        for key in added:
            os.environ[key] = defaults[key]
        try:
            yield
        finally:
            for key in added:
                os.environ.pop(key, None)


def client(uri: str):
    """An `mlflow.MlflowClient` for `uri`. A sqlite file that does not exist is an error (never created here)."""
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        raise TrackingError(f"no MLflow store at {db} (it is created by `embodyhpc submit`)")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _error_code(exc: BaseException) -> str | None:
    return getattr(exc, "error_code", None)


def _log_params(mlflow_client, run_id: str, params: Mapping[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
        mlflow_client.log_batch(run_id, params=items[start:start + MAX_PARAMS_PER_BATCH], synchronous=True)


# ---- runs ----
def get_or_create_experiment(mlflow_client, name: str, artifact_location: str | None) -> str:
    """The id of experiment `name`, created with `artifact_location` when missing (a concurrent creator is fine).

    Every experiment gets EXPERIMENT_KIND_TAG = model development when it has no kind yet: without it MLflow 3's UI
    opens the experiment on its GenAI view (traces) instead of the runs table. A kind set by someone else stays.
    """
    found = mlflow_client.get_experiment_by_name(name)
    if found is None:
        try:
            return mlflow_client.create_experiment(name, artifact_location=artifact_location,
                                                   tags={EXPERIMENT_KIND_TAG: MODEL_DEVELOPMENT})
        except Exception as exc:
            if _error_code(exc) != "RESOURCE_ALREADY_EXISTS":
                raise
            found = mlflow_client.get_experiment_by_name(name)
    if EXPERIMENT_KIND_TAG not in (found.tags or {}):  # made by an older embodyhpc, or by hand
        mlflow_client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, MODEL_DEVELOPMENT)
    return found.experiment_id


def create_run(uri: str, *, experiment: str, run_name: str, params: Mapping[str, Any] | None = None,
               tags: Mapping[str, Any] | None = None, artifact_location: str | None = None,
               status: str = "SCHEDULED", description: str | None = None,
               texts: Mapping[str, str] | None = None) -> str:
    """Create the training run (at submit time) and return its id.

    The experiment is created when missing, with `artifact_location` (default for sqlite stores: `mlartifacts`
    beside the database; for servers: the server's). `params` may be nested: keys are dotted
    (`train.lr`), long values truncated with a marker. The run starts as `status` (SCHEDULED: the jobs are queued;
    the training sink marks it RUNNING). `description` becomes the run's Description; `texts` are artifacts
    written from strings ({artifact path: text}, e.g. the resolved recipe).
    """
    if status not in ACTIVE_STATUSES:
        raise ValueError(f"create_run status must be one of {ACTIVE_STATUSES}, not {status!r}")
    init_store(uri)
    all_tags = tags_of({**(tags or {}), **({DESCRIPTION_TAG: description} if description else {})})
    with bounded_http(CLI_HTTP_ENV):
        try:
            mlflow_client = client(uri)
            experiment_id = get_or_create_experiment(
                mlflow_client, experiment, artifact_location or _default_artifact_location(uri))
            run = mlflow_client.create_run(experiment_id, run_name=run_name, tags=all_tags)
            run_id = run.info.run_id
            _log_params(mlflow_client, run_id, flatten_params(params or {}))
            for path, text in (texts or {}).items():
                mlflow_client.log_text(run_id, text, path)
            if status != "RUNNING":
                mlflow_client.update_run(run_id, status=status)
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"could not create the MLflow run in {uri}: {one_line(exc)}") from exc
    return run_id


def log_child_run(uri: str, parent_run_id: str, *, run_name: str, metrics: Mapping[str, float] | None = None,
                  step: int = 0, params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None,
                  artifacts: Sequence[tuple[str | os.PathLike[str], str | None]] = (),
                  status: str = "FINISHED", start_time_ms: int | None = None, end_time_ms: int | None = None,
                  texts: Callable[[str], Mapping[str, str]] | None = None) -> str:
    """A finished child run of `parent_run_id` in the parent's experiment; returns its id.

    Meant for the report job (any process): `metrics` at `step` (the checkpoint step evaluated; NaN/inf values are
    skipped and counted in `nonfinite_metrics`), `artifacts` as (local file or folder, artifact sub-folder or None)
    pairs, `texts(child_run_id)` artifacts written from strings ({artifact path: text}: a summary whose links name
    the child run). `start_time_ms`/`end_time_ms` (ms since the epoch): when what the run describes happened (the
    evaluation), not when it was logged; default: now. `status` FINISHED, FAILED or KILLED. Paths are checked before
    anything is created; if logging fails half-way the child run is marked FAILED.
    """
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"status must be one of {TERMINAL_STATUSES}, not {status!r}")
    missing = [str(local) for local, _ in artifacts if not Path(local).exists()]
    if missing:
        raise TrackingError(f"artifacts to log do not exist: {', '.join(missing)}")
    with bounded_http(CLI_HTTP_ENV):
        try:
            mlflow_client = client(uri)
            parent = mlflow_client.get_run(parent_run_id)
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"MLflow parent run {parent_run_id} not readable in {uri}: {one_line(exc)}") from exc
        try:
            run = mlflow_client.create_run(parent.info.experiment_id, run_name=run_name, start_time=start_time_ms,
                                           tags={**tags_of(tags), PARENT_TAG: parent_run_id})
        except Exception as exc:
            raise TrackingError(f"could not create the MLflow child run in {uri}: {one_line(exc)}") from exc
        run_id = run.info.run_id
        try:
            _log_params(mlflow_client, run_id, flatten_params(params or {}))
            log_step_metrics(mlflow_client, run_id, metrics or {}, step, timestamp_ms=end_time_ms)
            for local, subdir in artifacts:
                _upload(mlflow_client, run_id, Path(local), subdir)
            for path, text in (texts(run_id) if texts else {}).items():
                mlflow_client.log_text(run_id, text, path)
        except Exception as exc:
            with contextlib.suppress(Exception):
                mlflow_client.set_terminated(run_id, "FAILED")
            raise TrackingError(f"logging the MLflow child run {run_id} failed: {one_line(exc)}") from exc
        try:
            mlflow_client.set_terminated(run_id, status, end_time=end_time_ms)
        except Exception as exc:
            raise TrackingError(f"could not end the MLflow child run {run_id}: {one_line(exc)}") from exc
    return run_id


def log_step_metrics(mlflow_client, run_id: str, metrics: Mapping[str, Any], step: int, *,
                     timestamp_ms: int | None = None) -> None:
    """`metrics` at `step` (stamped `timestamp_ms`, default now) in as few log_batch calls as MLflow allows;
    NaN/inf and non-numbers are skipped and counted in NONFINITE_METRIC."""
    import time

    from mlflow.entities import Metric

    values, skipped = finite_metrics(metrics)
    if skipped:
        values[NONFINITE_METRIC] = float(skipped)
    now = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
    items = [Metric(key, value, now, step) for key, value in values.items()]
    for start in range(0, len(items), MAX_METRICS_PER_BATCH):
        mlflow_client.log_batch(run_id, metrics=items[start:start + MAX_METRICS_PER_BATCH], synchronous=True)


def _upload(mlflow_client, run_id: str, local: Path, subdir: str | None) -> None:
    if local.is_dir():
        mlflow_client.log_artifacts(run_id, str(local), artifact_path=subdir or None)
    else:
        mlflow_client.log_artifact(run_id, str(local), artifact_path=subdir or None)


def log_artifacts(uri: str, run_id: str,
                  paths: Sequence[str | os.PathLike[str] | tuple[str | os.PathLike[str], str | None]]) -> None:
    """Upload files or folders to an existing run; each item is a path or (path, artifact sub-folder)."""
    pairs = [item if isinstance(item, tuple) else (item, None) for item in paths]
    missing = [str(local) for local, _ in pairs if not Path(local).exists()]
    if missing:
        raise TrackingError(f"artifacts to log do not exist: {', '.join(missing)}")
    with bounded_http(CLI_HTTP_ENV):
        try:
            mlflow_client = client(uri)
            for local, subdir in pairs:
                _upload(mlflow_client, run_id, Path(local), subdir)
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"uploading artifacts to MLflow run {run_id} failed: {one_line(exc)}") from exc


def set_terminated(uri: str, run_id: str, status: str = "FINISHED", *, only_if_active: bool = False,
                   reason: str | None = None) -> bool:
    """End a run with FINISHED/FAILED/KILLED. `only_if_active`: leave a run that already ended alone.
    `reason` (FAILED/KILLED): why, on one line, in FAILURE_TAG and appended to the run's description.

    Returns whether the status was changed.
    """
    if status not in TERMINAL_STATUSES:
        raise ValueError(f"status must be one of {TERMINAL_STATUSES}, not {status!r}")
    with bounded_http(CLI_HTTP_ENV):
        try:
            mlflow_client = client(uri)
            run = mlflow_client.get_run(run_id)
            if only_if_active and run.info.status not in ACTIVE_STATUSES:
                return False
            if reason and status != "FINISHED":
                record_failure(mlflow_client, run_id, reason, run.data.tags.get(DESCRIPTION_TAG))
            mlflow_client.set_terminated(run_id, status)
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"could not end MLflow run {run_id}: {one_line(exc)}") from exc
    return True


def record_failure(mlflow_client, run_id: str, reason: str, description: str | None) -> None:
    """FAILURE_TAG = `reason` (one line), and the description gains a line saying so (the run page shows it)."""
    line = truncate(" ".join(str(reason).split()), 2000)
    mlflow_client.set_tag(run_id, FAILURE_TAG, line)
    note = f"**Failed:** {line}"
    if description and note not in description:
        note = f"{description}\n\n{note}"
    mlflow_client.set_tag(run_id, DESCRIPTION_TAG, truncate(note, MAX_TAG_VALUE_LENGTH))


# ---- reading back ----
def find_run(uri: str, run_id: str) -> dict[str, Any] | None:
    """A run's summary, or None when the store has no such run (or, for sqlite, no database file).

    Keys: run_id, name, status, experiment_id, experiment, start_time, end_time (ms since the epoch or None),
    artifact_uri, parent_run_id, metrics (latest value per key), params, tags. Raises TrackingError when the store
    cannot be reached.
    """
    db = sqlite_path(uri)
    if db is not None and not db.is_file():
        return None
    with bounded_http(CLI_HTTP_ENV):
        try:
            mlflow_client = client(uri)
            run = mlflow_client.get_run(run_id)
            experiment = mlflow_client.get_experiment(run.info.experiment_id)
        except Exception as exc:
            if _error_code(exc) in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise TrackingError(f"could not read MLflow run {run_id} from {uri}: {one_line(exc)}") from exc
    return {
        "run_id": run.info.run_id,
        "name": run.info.run_name,
        "status": run.info.status,
        "experiment_id": run.info.experiment_id,
        "experiment": experiment.name if experiment is not None else None,
        "start_time": run.info.start_time,
        "end_time": run.info.end_time,
        "artifact_uri": run.info.artifact_uri,
        "parent_run_id": run.data.tags.get(PARENT_TAG),
        "metrics": dict(run.data.metrics),
        "params": dict(run.data.params),
        "tags": dict(run.data.tags),
    }


def latest_metrics(uri: str, run_id: str) -> dict[str, float]:
    """The latest value of every metric of a run; TrackingError when the run does not exist."""
    found = find_run(uri, run_id)
    if found is None:
        raise TrackingError(f"no MLflow run {run_id} in {uri}")
    return found["metrics"]


LOCAL_UI = "http://127.0.0.1:5000"
ML_WORKFLOW = "workflowType=machine_learning"
"""MLflow 3.17's UI picks its GenAI or model-training screens from this (URL, else the browser's last choice,
else GenAI), not from the experiment's kind tag: links we print carry it so that they open on the runs table. (Its
experiments list does not pass it on: an experiment clicked there opens where the browser's last choice says.)"""


def ui_link(base: str, experiment_id: str | None = None, run_id: str | None = None) -> str:
    """The MLflow UI address of an experiment's runs table, or of one run's page, in the model-training screens."""
    base = base.rstrip("/")
    if experiment_id is None:
        return f"{base}/#/experiments?{ML_WORKFLOW}"
    page = f"/runs/{quote(run_id, safe='')}" if run_id else ""  # the experiment's own page: the UI picks the tab
    return f"{base}/#/experiments/{quote(str(experiment_id), safe='')}{page}?{ML_WORKFLOW}"


def ui_hint(uri: str, run_id: str | None = None) -> str:
    """The one line a user runs (or opens) to see the dashboards of the store `uri` (at the run `run_id`, when
    given and readable)."""
    experiment_id = None
    if run_id:
        with contextlib.suppress(Exception):  # a hint without the run's page is still a hint
            experiment_id = (find_run(uri, run_id) or {}).get("experiment_id")
    if is_http(uri):  # a link people paste: without the password (the browser asks for it)
        return ui_link(without_credentials(uri), experiment_id, run_id if experiment_id else None)
    return (f"mlflow ui --backend-store-uri {shlex.quote(mask_credentials(uri))} --port 5000   # then open "
            f"{ui_link(LOCAL_UI, experiment_id, run_id if experiment_id else None)}")


def __getattr__(name: str) -> Any:
    """`MlflowMetricsSink` lives in embodyhpc.tracking.mlflow_sink (which imports this module); reachable here too."""
    if name == "MlflowMetricsSink":
        from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink

        return MlflowMetricsSink
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
