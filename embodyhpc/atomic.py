"""The one atomic writer: a file is replaced whole or not at all, so a reader never sees a torn one.

Below everything that writes a file others read while it changes (run.json and every JSON file of a run, a staging
manifest, checkpoint metadata, evaluation shards, plots): embodyhpc/rundir.py names the files, this writes them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def replace_atomically(path: Path, write: Callable[[Path], object], *, durable: bool = False) -> None:
    """Write `path` whole or not at all: `write` fills a private (0600) temp file beside it, which then replaces
    `path` (os.replace is atomic on POSIX filesystems), so readers see the old file or the new one, never a torn
    one. durable: the file and its folder are fsynced too (it survives a crash of the node, not just the process)."""
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        if durable:
            _fsync(tmp, os.O_RDONLY)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync(path.parent, os.O_RDONLY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any, *, durable: bool = False, indent: int | None = 2) -> None:
    """Every JSON file of a run is written this way: readers (status, the report job) never see a half-written
    file. indent=None writes compact JSON (large files such as a staging manifest)."""
    text = json.dumps(data, indent=indent) if indent else json.dumps(data, separators=(",", ":"))
    replace_atomically(path, lambda tmp: tmp.write_text(text + "\n"), durable=durable)


def write_jsonl_atomic(path: Path, records: Iterable[Any], *, durable: bool = False) -> None:
    """A JSON-lines file (one record per line, e.g. an evaluation shard), whole or not at all."""
    text = "".join(json.dumps(record) + "\n" for record in records)
    replace_atomically(path, lambda tmp: tmp.write_text(text), durable=durable)

