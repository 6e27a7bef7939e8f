"""Polling helpers for tests that wait on real jobs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def run_dir_from(out: str) -> Path:
    """The run directory from `embodyhpc submit --json` output."""
    return Path(json.loads(out)["run_dir"])


def statuses(cli, run_dir: Path) -> dict[str, dict]:
    result = cli("status", str(run_dir), "--json")
    assert result.code == 0, result.err
    return {job["kind"]: job for job in json.loads(result.out)["jobs"]}


DOUBLES = Path(__file__).resolve().parent / "doubles"


def use_doubles(*packages: str) -> None:
    """Make `import <package>` load the CPU double in tests/doubles (first on sys.path, cached modules dropped).
    For worker processes; tests use the fixtures built on it (tests/models/conftest.py)."""
    import sys

    if str(DOUBLES) not in sys.path:
        sys.path.insert(0, str(DOUBLES))
    drop_modules(*packages)


def drop_modules(*packages: str) -> None:
    import sys

    for name in list(sys.modules):
        if name.split(".")[0] in packages:
            del sys.modules[name]
