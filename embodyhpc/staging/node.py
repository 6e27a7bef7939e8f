"""The in-job stage step: one copier per node (local rank 0), the node's other ranks wait for it.

It runs before torch.distributed exists, so the ranks of a node coordinate through files in DEST:

    .embodyhpc-stage.markers/<job>.running   the copier's heartbeat (mtime refreshed while it works)
    .embodyhpc-stage.markers/<job>.done      the copier's StageResult, as JSON
    .embodyhpc-stage.markers/<job>.failed    why the copier failed

<job> names this job step (SLURM_JOB_ID.SLURM_STEP_ID.SLURM_RESTART_COUNT by default), so markers of an
earlier job or of the run before a requeue never release this run's ranks, and jobs sharing a node each
get their own. Copiers of different jobs staging into the same DEST take turns through stage()'s lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from embodyhpc.atomic import write_json_atomic
from embodyhpc.staging.errors import NodeStagingError, StageInputError
from embodyhpc.staging.manifest import CONTROL_PREFIX
from embodyhpc.staging.stage import StageResult, stage

MARKERS_DIR = CONTROL_PREFIX + ".markers"
MARKER_MAX_AGE_S = 7 * 24 * 3600.0
"""Markers of other jobs older than this are deleted by the next copier (never younger ones: their
ranks may still be reading them)."""


def node_local_path(nvme_dir: str | os.PathLike, src: str | os.PathLike) -> Path:
    """Where `src` is staged under `nvme_dir`: its folder name plus a hash of its absolute path, so two
    datasets with the same folder name never share (and delete) one staged copy."""
    absolute = os.path.abspath(src)
    digest = hashlib.blake2b(absolute.encode(), digest_size=4).hexdigest()
    return Path(nvme_dir) / f"{os.path.basename(absolute.rstrip('/')) or 'root'}-{digest}"


def job_id_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """An id the ranks of one job step share: from Slurm, else from torchrun; None outside both."""
    if environ.get("SLURM_JOB_ID"):
        return ".".join([environ["SLURM_JOB_ID"], environ.get("SLURM_STEP_ID", "batch"),
                         environ.get("SLURM_RESTART_COUNT", "0")])
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun-{run_id}" if run_id and run_id != "none" else None


def stage_on_node(src: str | os.PathLike, dest: str | os.PathLike, *, local_rank: int, job_id: str | None = None,
                  workers: int = 8, verify: bool | str = "quick", progress: bool = True,
                  timeout_s: float = 6 * 3600.0, poll_s: float = 1.0, stale_s: float = 120.0) -> StageResult:
    """Stage `src` into `dest` once per node; every local rank returns the copier's StageResult.

    local_rank 0 runs `stage(src, dest, workers=, verify=, progress=)`; the other local ranks poll every
    `poll_s` for its completion and raise NodeStagingError when it failed (with its reason), when its
    heartbeat is older than `stale_s` (killed or hung), or after `timeout_s`. job_id: shared by the ranks
    of this job step; defaults to job_id_from_env(). Call it once per job step and destination.
    """
    if not isinstance(local_rank, int) or local_rank < 0:
        raise StageInputError(f"local_rank must be an integer >= 0, got {local_rank!r}", key="local_rank",
                              fix="pass the rank within the node (SLURM_LOCALID or LOCAL_RANK)")
    token = job_id if job_id is not None else job_id_from_env()
    if not token:
        raise StageInputError("cannot tell which job this process belongs to: neither SLURM_JOB_ID nor "
                              "TORCHELASTIC_RUN_ID is set", key="job_id",
                              fix="pass job_id=, any string the ranks of this node share for this run")
    markers = Path(dest) / MARKERS_DIR
    name = re.sub(r"[^A-Za-z0-9._-]", "_", token)
    running, done, failed = (markers / f"{name}.{kind}" for kind in ("running", "done", "failed"))
    if local_rank == 0:
        return _copy(src, dest, markers, running, done, failed, stale_s,
                     dict(workers=workers, verify=verify, progress=progress))
    return _wait(src, dest, running, done, failed, timeout_s, poll_s, stale_s)


def _copy(src: str | os.PathLike, dest: str | os.PathLike, markers: Path, running: Path, done: Path, failed: Path,
          stale_s: float, options: dict) -> StageResult:
    markers.mkdir(parents=True, exist_ok=True)
    for path in (done, failed):
        path.unlink(missing_ok=True)
    write_json_atomic(running, {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()},
                      durable=True)
    heartbeat = _Heartbeat(running, interval_s=min(5.0, stale_s / 4))
    marked = False
    try:
        result = stage(src, dest, **options)
        write_json_atomic(done, {"result": asdict(result)}, durable=True)
        marked = True
    except BaseException as exc:
        reason = exc.one_line() if hasattr(exc, "one_line") else f"{type(exc).__name__}: {exc}"
        try:
            write_json_atomic(failed, {"reason": " ".join(reason.split()), "host": socket.gethostname(),
                                       "pid": os.getpid()}, durable=True)
            marked = True
        except OSError:
            pass  # the waiters notice the heartbeat stop instead
        raise
    finally:
        heartbeat.stop()
        if marked:
            running.unlink(missing_ok=True)
    _remove_old_markers(markers)
    return result


def _wait(src: str | os.PathLike, dest: str | os.PathLike, running: Path, done: Path, failed: Path,
          timeout_s: float, poll_s: float, stale_s: float) -> StageResult:
    deadline = time.monotonic() + timeout_s
    log_hint = "see local rank 0's log on this node"
    while True:
        if done.exists():
            return StageResult(**json.loads(done.read_text())["result"])
        if failed.exists():
            reason = json.loads(failed.read_text())["reason"]
            raise NodeStagingError(f"local rank 0 failed to stage {src}: {reason}", where=str(dest),
                                   fix=f"{log_hint}; fix the cause and resubmit")
        try:
            heartbeat_age_s: float | None = time.time() - running.stat().st_mtime
        except FileNotFoundError:
            heartbeat_age_s = None
        if heartbeat_age_s is not None and heartbeat_age_s > stale_s and not done.exists() and not failed.exists():
            raise NodeStagingError(f"local rank 0 stopped staging {src} without finishing: no heartbeat for "
                                   f"{heartbeat_age_s:.0f} s (killed or hung)", where=str(dest),
                                   fix=f"{log_hint}; resubmit (staging resumes)")
        if time.monotonic() >= deadline:
            started = "it never started" if heartbeat_age_s is None else "it is still copying"
            raise NodeStagingError(f"gave up after {timeout_s:.0f} s waiting for local rank 0 to stage {src} "
                                   f"({started})", where=str(dest),
                                   fix=f"{log_hint}; for a large dataset allow a longer staging timeout")
        time.sleep(poll_s)


class _Heartbeat:
    """Touches the running marker from a daemon thread so waiters can tell a slow copier from a dead one."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self._path = path
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="embodyhpc-stage-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval_s):
            try:
                os.utime(self._path)
            except OSError:
                pass

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


def _remove_old_markers(markers: Path) -> None:
    now = time.time()
    for path in markers.iterdir():
        try:
            if now - path.stat().st_mtime > MARKER_MAX_AGE_S:
                path.unlink()
        except OSError:
            pass
