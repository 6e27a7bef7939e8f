"""The lock on a run folder: one command changes a run at a time, and a second is told who holds it.

    with run_lock(run, "embodyhpc resume"):         # a second one: RunInUseError (exit 2), one line naming the
        ...                                         # holder: `embodyhpc resume` (pid 4242 on n1, since ...)

Who takes it, and how:
- exclusive: `embodyhpc resume` (from reading run.json to its chain submitted; a chain run on this machine until it
  ends), `cancel` (while it cancels), `submit` (the folder it fills, until its chain is submitted);
- shared: `eval --ckpt` of a run's checkpoint or export (it reads the run's resolved.yaml and weights and writes
  its pin and exports/step-N there), and a chain running on this machine once its `submit` or `resume` has set it
  up (RunLock.share): evaluations of a run that trains here may go on beside it, a resume may not.
A command that only reads (status, logs, runs, `resume --dry-run`) takes none: every file it reads is replaced
whole (atomic.replace_atomically), never rewritten in place.

How: flock(2) on <run>/.embodyhpc.lock (rundir.LOCK_FILE), never waiting (LOCK_NB): a command that finds the run
held stops at once instead of queueing behind an hour-long chain. The holder writes one JSON line naming itself
(host, pid, command, since) into the file; a refused command reads those lines (on its own host keeping only the
pids /proc/locks shows holding this file) and names them. The kernel drops a flock when the last descriptor of the
holder's open file closes, which a process's death does: a crashed holder never leaves the run locked, and its line
is ignored (its pid holds nothing) and overwritten by the next exclusive holder. The descriptor is close-on-exec,
so the jobs a local chain starts (new programs) do not inherit the lock; a child forked without exec would, and
would keep the run locked as long as it lives.

Shared filesystems (where run folders live on a cluster):
- NFS: Linux clients implement flock as a whole-file byte-range lock on the server (NLM for v3, the protocol's
  own locks for v4), so it excludes processes on every node; mounted with `nolock` or `local_lock=flock|all` it
  only excludes processes on the same node. A holder whose *node* crashes keeps the lock until the server reclaims
  it (the NFSv4 lease, typically 90 s; NLM when the node reboots): the run reads as held until then.
- Lustre: flock is coherent across nodes with the `flock` mount option, node-local with `localflock`; with
  `noflock` (or where locks are refused: ENOLCK, ENOSYS, EOPNOTSUPP) the command warns and goes on unlocked, since
  refusing would make the run unusable there.
- GPFS/Spectrum Scale, BeeGFS, WekaFS: cluster-wide flock.
The lock keeps two embodyhpc commands apart; it does not stop a person editing or copying files meanwhile.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from embodyhpc.errors import RunDirError
from embodyhpc.rundir import LOCK_FILE

MAX_RECORD_BYTES = 64 << 10  # the holder lines read back: far more than embodyhpc writes
_UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
_READ_ONLY = {errno.EACCES, errno.EPERM, errno.EROFS}
_WAIT_FOR_RECORD_S = 0.5  # a holder writes its line right after locking: how long a refused command looks for it


class RunInUseError(RunDirError):
    """Another command holds the run folder (exit 2: run the command again once it is done)."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    command: str
    since: str
    mode: str  # exclusive | shared

    def text(self) -> str:
        return f"`{self.command}` (pid {self.pid} on {self.host}, since {self.since})"


class RunLock:
    """A run folder's lock (module docstring). `with RunLock(...)` takes it or raises RunInUseError; `held` is False
    when the filesystem has no locks, or (shared) when the folder is read-only to this user."""

    def __init__(self, run: str | Path, command: str, *, shared: bool = False,
                 progress: Callable[[str], None] = print) -> None:
        self.run, self.command, self.shared, self.progress = Path(run), command, shared, progress
        self.path = self.run / LOCK_FILE
        self.held = False
        self._fd: int | None = None
        self._writable = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        fd = self._open()
        if fd is None:
            return
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._in_use() from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _UNSUPPORTED:
                raise RunDirError(f"cannot lock the run folder: {exc.strerror or exc}", where=str(self.path),
                                  fix="check that its filesystem is mounted and writable") from None
            self.progress(f"warning: the filesystem of {self.run} has no file locks ({exc.strerror or exc}): "
                          f"another command could change this run while `{self.command}` does (NFS: mount "
                          "without `nolock`; Lustre: mount with `-o flock`)")
            return
        self._fd, self.held = fd, True
        self._record(truncate=not self.shared)

    def share(self) -> None:
        """Exclusive -> shared, for the time a chain runs here: evaluations may read the run, a resume may not."""
        if not self.held or self.shared or self._fd is None:
            return
        self.shared = True
        self._record(truncate=True)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # Linux converts in place; another command slipped in between: it owns the run now
            self.release()
            raise self._in_use() from None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._writable and not self.shared:
                os.ftruncate(fd, 0)  # an exclusive holder was alone: the file names nobody once it is done
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass  # closing releases it all the same
        finally:
            os.close(fd)
            self.held = False

    def _open(self) -> int | None:
        flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # never through a symlink; never block on a FIFO
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | flags, 0o600)
            self._writable = True
        except OSError as exc:
            fd = None
            if exc.errno == errno.ELOOP:
                raise RunDirError("is a symbolic link, not the lock file embodyhpc writes", where=str(self.path),
                                  fix="remove it (`rm` it; it holds nothing but who last changed the run)") from None
            if exc.errno == errno.EISDIR:
                raise _not_a_file(self.path) from None
            if exc.errno not in _READ_ONLY or not self.shared:
                raise RunDirError(f"cannot lock the run folder to change it: {exc.strerror or exc}",
                                  where=str(self.path), fix="run it as the run's owner, on a writable mount") from None
            try:  # someone else's or a read-only run, only read: lock it if its lock file exists, else go on
                fd = os.open(self.path, os.O_RDONLY | flags)
            except OSError:
                return None
        if not _is_regular(fd):
            os.close(fd)
            raise _not_a_file(self.path)
        return fd

    def _record(self, *, truncate: bool) -> None:
        if not self._writable or self._fd is None:
            return
        line = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "command": self.command,
                           "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "mode": "shared" if self.shared else "exclusive"})
        try:
            if truncate:
                os.ftruncate(self._fd, 0)
            os.write(self._fd, (line + "\n").encode())  # O_APPEND: one write, after the lines of other holders
        except OSError:
            pass  # a full disk costs the name in a refusal, not the lock

    def _in_use(self) -> RunInUseError:
        deadline = time.monotonic() + _WAIT_FOR_RECORD_S
        found = holders(self.run)
        while not found and time.monotonic() < deadline:  # it locked a moment ago and is writing its line
            time.sleep(0.05)
            found = holders(self.run)
        who = found[0].text() if found else "another process (it has not said which)"
        more = f" and {len(found) - 1} more" if len(found) > 1 else ""
        return RunInUseError(f"in use by {who}{more}; `{self.command}` changes nothing while another command "
                             "holds the run", where=str(self.run),
                             fix="run it again once that one is done (a holder that dies frees the run at once)")


def run_lock(run: str | Path, command: str, *, shared: bool = False,
             progress: Callable[[str], None] = print) -> RunLock:
    """`with run_lock(run, "embodyhpc resume"):` (RunLock)."""
    return RunLock(run, command, shared=shared, progress=progress)


def holders(run: str | Path) -> list[Holder]:
    """Who holds the run's lock now, newest first: the lines the lock file holds, less those of processes on this
    host that hold no lock on it (crashed, or done). Holders on other hosts cannot be checked and are all listed."""
    path = Path(run) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        if not _is_regular(fd):
            return []
        size = os.fstat(fd).st_size
        os.lseek(fd, max(size - MAX_RECORD_BYTES, 0), os.SEEK_SET)
        raw = os.read(fd, MAX_RECORD_BYTES)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    lockers = _local_lock_pids(st.st_dev, st.st_ino)
    host = socket.gethostname()
    found: list[Holder] = []
    for line in reversed(raw.decode("utf-8", "replace").splitlines()):
        holder = _holder(line)
        if holder is None or any((h.host, h.pid) == (holder.host, holder.pid) for h in found):
            continue
        if holder.host == host and not _holds(holder.pid, lockers):
            continue
        found.append(holder)
    return found


def _holder(line: str) -> Holder | None:
    try:
        data = json.loads(line)
        holder = Holder(**{key: data[key] for key in ("host", "pid", "command", "since", "mode")})
    except (ValueError, TypeError, KeyError):
        return None
    if not (isinstance(holder.pid, int) and not isinstance(holder.pid, bool) and all(
            isinstance(v, str) for v in (holder.host, holder.command, holder.since, holder.mode))):
        return None
    clean = {k: "".join(c for c in v if c.isprintable())[:200] for k, v in
             (("host", holder.host), ("command", holder.command), ("since", holder.since), ("mode", holder.mode))}
    return Holder(pid=holder.pid, **clean)


def _local_lock_pids(dev: int, ino: int) -> set[int] | None:
    """The pids /proc/locks shows holding a lock on this file (None where there is no /proc/locks)."""
    want = (f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}", f"{os.major(dev)}:{os.minor(dev)}:{ino}")
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    pids = set()
    for line in text.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 00:2d:1234 0 EOF"; a waiter's line has "->" after the number
        fields = [f for f in fields if f != "->"]
        if len(fields) >= 6 and fields[5] in want and fields[4].isdigit():
            pids.add(int(fields[4]))
    return pids


def _holds(pid: int, lockers: set[int] | None) -> bool:
    if lockers is not None:
        return pid in lockers
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def _not_a_file(path: Path) -> RunDirError:
    return RunDirError("is not a regular file (a FIFO, device or folder)", where=str(path),
                       fix="remove it; embodyhpc makes a fresh lock file")


def _is_regular(fd: int) -> bool:
    import stat

    return stat.S_ISREG(os.fstat(fd).st_mode)
