"""Weights & Biases as a second sink beside MLflow (`tracking.backends: [mlflow, wandb]`).

MLflow stays the run's record and the documented dashboard; W&B gets the same metric names for teams that live there:

    training, rank 0    WandbSink(run_dir, tracking, ...).write(step, {"loss": ...}) -> train/loss at `step`
    report job          log_evaluation_wandb(...): eval/trained/success_rate, eval/<task>/success_rate, success_rate
                        against `checkpoint_step` (define_metric: the eval charts' x axis), the plots as images and
                        the kept rollout videos in the media panel, each with the checkpoint step

The W&B run id is the one the run folder holds (`<run>/wandb/run-id`, written by the first job that needs it: the
MLflow run id when there is one, so the two are found from each other); every job of the run, a requeued or resumed
attempt and the evaluations of its checkpoints, continues that id (resume="allow").

Mode: offline unless the recipe says `tracking.wandb_mode: online` (compute nodes often have no internet). Each
process writes an offline folder `<run>/wandb/offline-run-<time>-<id>`; upload them later with
`wandb sync --yes <run>/wandb/offline-run-*` (files of one run are synced in order of their start). Like the MLflow
sink, nothing here ever raises into training or the report: a problem is one line on stderr.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TextIO

from embodyhpc.errors import mask_credentials

WANDB_DIR = "wandb"
"""The folder W&B writes under a run folder (its own layout below)."""
RUN_ID_FILE = "run-id"
CHECKPOINT_STEP = "checkpoint_step"
"""The x axis of every eval/* chart (define_metric): the checkpoint step an evaluation read."""
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def enabled(tracking: Any) -> bool:
    return bool(tracking.enabled) and "wandb" in tracking.backends


def wandb_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / WANDB_DIR


def wandb_run_id(run_dir: str | os.PathLike[str], preferred: str | None = None) -> str:
    """The W&B run id of the run folder `run_dir`: the one stored there, else `preferred` (the MLflow run id) or a
    new one, stored for every later job. A stored id that is not a W&B id is an error naming the file."""
    path = wandb_dir(run_dir) / RUN_ID_FILE
    if path.is_file():
        stored = path.read_text().strip()
        if not _ID.match(stored):
            raise ValueError(f"{path}: {stored[:80]!r} is not a W&B run id (letters, digits, _ and -; at most 64); "
                             "delete the file to start a new W&B run")
        return stored
    chosen = preferred if preferred and _ID.match(preferred) else uuid.uuid4().hex
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(chosen + "\n")
    try:
        os.link(temporary, path)  # the first job to store an id wins; a concurrent one reads it back
    except FileExistsError:
        return wandb_run_id(run_dir)
    finally:
        temporary.unlink(missing_ok=True)
    return chosen


def start_run(run_dir: str | os.PathLike[str], tracking: Any, *, project: str, run_id: str,
              name: str | None = None, config: Mapping[str, Any] | None = None, job_type: str = "train",
              group: str | None = None) -> Any:
    """wandb.init for the run `run_id` (continued when it exists: resume="allow"), files under `run_dir`/wandb,
    offline unless tracking.wandb_mode is online; no console capture, code or git snapshot, nor system stats (the
    MLflow side samples telemetry)."""
    import wandb

    folder = wandb_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    settings = wandb.Settings(mode=tracking.wandb_mode, silent=True, console="off", save_code=False,
                              disable_git=True, disable_job_creation=True, x_disable_stats=True)
    return wandb.init(project=project, entity=tracking.wandb_entity, id=run_id, resume="allow", name=name,
                      dir=str(run_dir), config=dict(config or {}), job_type=job_type, group=group,
                      settings=settings)


def _say(message: str, stream: TextIO | None = None) -> None:
    try:
        print(f"embodyhpc: {mask_credentials(message)}", file=stream or sys.stderr, flush=True)
    except Exception:  # noqa: BLE001 - a closed stream must not matter either
        pass


class WandbSink:
    """The training loop's W&B sink (`embodyhpc.train.metrics.MetricsSink`): `prefix` + each key at `step`.
    Opened on the first write; never raises (one line on stderr, then the sink goes quiet)."""

    def __init__(self, run_dir: str | os.PathLike[str], tracking: Any, *, project: str, run_id: str,
                 name: str | None = None, prefix: str = "train/", config: Mapping[str, Any] | None = None,
                 stream: TextIO | None = None) -> None:
        self.run_dir, self.tracking, self.project, self.run_id = Path(run_dir), tracking, project, run_id
        self.name, self.prefix, self.config, self._stream = name, prefix, config, stream
        self._run: Any = None
        self._broken = False
        self.sent = 0

    def _open(self) -> Any:
        if self._run is None and not self._broken:
            try:
                self._run = start_run(self.run_dir, self.tracking, project=self.project, run_id=self.run_id,
                                      name=self.name, config=self.config)
            except Exception as exc:  # noqa: BLE001 - W&B never stops training
                self._broken = True
                _say(f"W&B run {self.run_id} not started ({type(exc).__name__}: {exc}); training goes on without "
                     "W&B (MLflow has every metric)", self._stream)
        return self._run

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        run = self._open()
        if run is None:
            return
        try:
            values = {f"{self.prefix}{key}": float(value) for key, value in metrics.items()
                      if isinstance(value, int | float) and value == value and abs(value) != float("inf")}
            run.log(values, step=int(step))
            self.sent += len(values)
        except Exception as exc:  # noqa: BLE001
            self._broken, self._run = True, None
            _say(f"W&B logging stopped ({type(exc).__name__}: {exc})", self._stream)

    def flush(self, *, force: bool = False) -> bool:
        return True

    @property
    def offline_dir(self) -> str | None:
        return getattr(self._run, "dir", None) and str(Path(self._run.dir).parent)

    def close(self, status: str | None = None, *, reason: str | None = None) -> None:
        """Finish the W&B run: exit code 0 for FINISHED, 1 otherwise; RUNNING (a requeue) leaves it resumable."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            where = str(Path(run.dir).parent) if getattr(run, "dir", None) else str(wandb_dir(self.run_dir))
            run.finish(exit_code=0 if status in (None, "FINISHED", "RUNNING") else 1)
            if self.tracking.wandb_mode == "offline":
                _say(f"W&B (offline): upload with `wandb sync --yes {where}`", self._stream)
        except Exception as exc:  # noqa: BLE001
            _say(f"could not finish W&B run {self.run_id}: {type(exc).__name__}: {exc}", self._stream)


def log_evaluation_wandb(run_dir: str | os.PathLike[str], tracking: Any, *, project: str, run_id: str,
                         step: int | None, metrics: Mapping[str, float], images: Mapping[str, Path] = {},
                         videos: Iterable[Path] = (), adhoc_of: str | None = None, name: str | None = None) -> str:
    """One evaluation into W&B: `metrics` (the names MLflow's training run gets) with CHECKPOINT_STEP = `step`,
    `images` ({key: png}) and the rollout `videos` (mp4) under eval/videos/<policy>/<task>, captioned with the
    episode and the step. `adhoc_of`: an `eval --ckpt` of the training run with that W&B id goes into a run of its
    own (`run_id`) grouped with it, never into the training run's charts. Returns the W&B run id."""
    import wandb

    run = start_run(run_dir, tracking, project=project, run_id=run_id, name=name,
                    job_type="eval" if adhoc_of else "train", group=adhoc_of)
    try:
        run.define_metric(CHECKPOINT_STEP)
        run.define_metric("eval/*", step_metric=CHECKPOINT_STEP)
        run.define_metric("success_rate", step_metric=CHECKPOINT_STEP)
        row: dict[str, Any] = {key: float(value) for key, value in metrics.items()}
        row[CHECKPOINT_STEP] = -1 if step is None else int(step)
        for key, path in images.items():
            row[f"eval/plots/{key}"] = wandb.Image(str(path), caption=f"step {step}")
        by_key: dict[str, list[Any]] = {}
        for video in sorted(videos):
            key = f"eval/videos/{video.parent.parent.name}/{video.parent.name}"  # <policy>/<task>/<file>.mp4
            by_key.setdefault(key, []).append(wandb.Video(str(video), caption=f"step {step}: {video.stem}"))
        row.update(by_key)
        run.log(row)
    finally:
        run.finish()
    return run_id


__all__ = ["CHECKPOINT_STEP", "RUN_ID_FILE", "WANDB_DIR", "WandbSink", "enabled", "log_evaluation_wandb",
           "start_run", "wandb_dir", "wandb_run_id"]
