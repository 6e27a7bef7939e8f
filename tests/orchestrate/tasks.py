"""Job tasks for the orchestration tests, started by their import name as the real ones are."""

from __future__ import annotations

from pathlib import Path


def record(run_dir: str, shard: int | None = None) -> None:
    """Append which job ran (and its shard) to <run>/calls.txt."""
    import os

    with (Path(run_dir) / "calls.txt").open("a") as f:
        f.write(f"{os.environ.get('EMBODYHPC_RUN_DIR') == run_dir} {shard}\n")


def fail(run_dir: str) -> None:
    raise RuntimeError("this task fails on purpose")
