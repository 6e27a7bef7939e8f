"""Find and follow the per-task log files submitit writes for each job of a run; read the last step the training
job logged to its metrics file."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from embodyhpc.rundir import METRICS_FILE, submitit_folder
from embodyhpc.runinfo import RunInfo


def log_files(info: RunInfo, kind: str | None = None) -> list[tuple[str, Path]]:
    """(label, path) for every existing stdout/stderr file of the chosen jobs, in chain order, attempt after attempt
    (a resumed run's earlier attempts first, their labels prefixed `attempt N`)."""
    folder = submitit_folder(Path(info.run_dir))
    found: list[tuple[str, Path]] = []
    attempts = info.all_attempts()
    for attempt in attempts:
        tag = f"attempt {attempt.number} " if len(attempts) > 1 else ""
        found += [(tag + label, path) for label, path in _job_logs(folder, attempt.jobs.values(), kind)]
    return found


def _job_logs(folder: Path, records, kind: str | None) -> list[tuple[str, Path]]:
    found: list[tuple[str, Path]] = []
    for record in records:
        if kind and record.kind != kind or not record.job_id:
            continue
        if record.element_ids:  # local arrays: one process per element
            prefixes = [(f"{record.kind}[{i}]", eid) for i, eid in enumerate(record.element_ids)]
        elif record.array_size:
            prefixes = [(f"{record.kind}[{i}]", f"{record.job_id}_{i}") for i in range(record.array_size)]
        else:
            prefixes = [(record.kind, record.job_id)]
        for label, prefix in prefixes:
            for path in sorted(p for p in folder.glob(f"{prefix}_*_log.*") if p.is_file()):  # no FIFO to hang on
                task = path.name[len(prefix) + 1:].split("_")[0]
                found.append((f"{label} task {task} {path.suffix[1:]}", path))
    return found


def follow(paths: Callable[[], list[tuple[str, Path]]], done: Callable[[], bool],
           poll_s: float = 1.0) -> Iterator[str]:
    """Yield new lines from every log file until `done()` and nothing more arrives.

    A line still being written (no newline yet) waits for its end, so it is printed once and whole; at the end
    what is left is printed as it is. A file that cannot be read is skipped this round and tried again."""
    offsets: dict[Path, int] = {}
    pending: dict[Path, bytes] = {}
    while True:
        finished = done()
        for label, path in paths():
            try:
                with path.open("rb") as f:
                    f.seek(offsets.get(path, 0))
                    data = f.read()
                    offsets[path] = f.tell()
            except OSError:
                continue
            data = pending.pop(path, b"") + data
            complete, newline, rest = data.rpartition(b"\n")
            if not newline:
                complete, rest = b"", data
            if finished and rest:
                complete, rest = data, b""
            if rest:
                pending[path] = rest
            for line in complete.decode(errors="replace").splitlines():
                yield f"[{label}] {line}"
        if finished:
            return
        time.sleep(poll_s)


# ---- training progress, from the metrics file the training job appends to ----
_METRICS_TAIL_BYTES = 64 << 10  # the last logged steps; a line is a few hundred bytes


@dataclass(frozen=True)
class MetricsLine:
    """The last step the training job logged (METRICS_FILE) and when the file last changed."""

    step: int
    values: dict[str, float]
    """Every finite number of the line (loss, lr, step_time_s, tokens_per_s, ...)."""
    updated: float
    """The file's mtime (seconds since the epoch)."""


def read_last_metrics(run_dir: str | Path) -> MetricsLine | None:
    """The last complete line of METRICS_FILE; None before the first logged step. Reads only the file's tail; a
    line still being written, or one that is not a metrics record, is passed over for the one before it."""
    path = Path(run_dir) / METRICS_FILE
    try:
        if not path.is_file():  # no FIFO to hang on
            return None
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - _METRICS_TAIL_BYTES))
            tail = f.read(_METRICS_TAIL_BYTES)
            updated = os.fstat(f.fileno()).st_mtime
    except OSError:
        return None
    lines = tail.split(b"\n")
    complete = lines[:-1] if not tail.endswith(b"\n") else lines
    for raw in reversed(complete):
        try:
            record = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
        except (ValueError, RecursionError):
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            values = {k: float(v) for k, v in record.items()
                      if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            return MetricsLine(step, values, updated)
    return None


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a metrics line holds")
