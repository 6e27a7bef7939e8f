"""The lock that serializes staging runs into one folder, across jobs sharing a node."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from embodyhpc.staging.errors import StagingError
from embodyhpc.staging.manifest import CONTROL_PREFIX

LOCK_NAME = CONTROL_PREFIX + ".lock"


class LockReplacedError(StagingError):
    """The lock file this run waited on was removed (a failed first run cleaned up its folder): retry."""


def _still_linked(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


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
        if exclusive and not _still_linked(fd, path):
            raise LockReplacedError("the staging run before this one removed the folder while this run waited",
                                    where=str(dest), fix="stage again")
        yield
    finally:
        os.close(fd)
