"""Expensive things built once per test run and shared by every test and every pytest-xdist worker that needs them:
a demonstration dataset, a trained policy. A session fixture alone is once per worker; this is once per run.

`build_once(tmp_path_factory, name, build)` gives the folder `<run's basetemp>/shared/<name>`: the first caller runs
`build(folder)` under an exclusive lock, the others wait for it (a bounded wait) and reuse the folder. A build that
failed is not run again by the next caller: it fails at once with the first builder's error, so one broken
artifact costs its build once, not once per test.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
from _pytest.outcomes import Skipped

DONE, FAILED = ".built", ".failed"


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every worker of this run sees: xdist workers get basetemp/popen-gwN of one run's basetemp."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"


def build_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None], *,
               wait_s: float = 3600.0) -> Path:
    folder = shared_root(tmp_path_factory) / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _locked(folder.with_name(f"{name}.lock"), wait_s, name):
        if (folder / DONE).is_file():
            return folder
        if (folder / FAILED).is_file():
            pytest.fail(f"the shared artifact {name!r} failed to build earlier in this run:\n"
                        f"{(folder / FAILED).read_text()}", pytrace=False)
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        try:
            build(folder)
        except Skipped:  # a missing optional dependency: the next caller skips for itself
            shutil.rmtree(folder, ignore_errors=True)
            raise
        except BaseException:
            (folder / FAILED).write_text(traceback.format_exc()[-4000:])
            raise
        (folder / DONE).write_text("")
    return folder


class _locked:
    """An exclusive flock on `path`, waited for at most `wait_s` (another worker building the artifact)."""

    def __init__(self, path: Path, wait_s: float, name: str) -> None:
        self.path, self.wait_s, self.name = path, wait_s, name

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    pytest.fail(f"waited {self.wait_s:.0f} s for another worker to build {self.name!r}",
                                pytrace=False)
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
