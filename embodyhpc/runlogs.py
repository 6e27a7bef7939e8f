"""Find and follow the per-task log files submitit writes for each job of a run."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

from embodyhpc.rundir import RunInfo, submitit_folder


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
