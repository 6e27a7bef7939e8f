"""The lock that serializes staging runs into one folder, across jobs sharing a node."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from embodyhpc.data.staging.errors import StagingError
from embodyhpc.data.staging.manifest import CONTROL_PREFIX

LOCK_NAME = CONTROL_PREFIX + ".lock"


@contextmanager
def dest_lock(dest: Path, *, exclusive: bool, announce: Callable[[str], None] | None = None) -> Iterator[None]:
    """flock on DEST/.embodyhpc-stage.lock: exclusive for staging, shared for verification.

    flock (not fcntl record locks) belongs to the open file, so threads of one process exclude each other
    too, and the kernel drops it when its holder dies: a killed job never leaves DEST locked.
    """
    path = dest / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exclusive:
            raise StagingError(f"cannot create the lock file ({exc.strerror})", where=str(path),
                               fix="stage into a folder you can write") from exc
        yield  # a staged copy we may only read: nobody can be staging into it as us
        return
    try:
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            if announce is not None:
                announce(f"stage: waiting for another staging run into {dest} to finish")
            fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)
