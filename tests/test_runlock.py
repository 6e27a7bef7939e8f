"""The run folder's lock (embodyhpc.runlock) with real processes: one holder at a time, the others refused naming
it, freed by the kernel when its holder dies, and a lock file someone tampered with never followed or trusted."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embodyhpc.errors import RunDirError
from embodyhpc.runlock import RunInUseError, RunLock, holders

HOST = socket.gethostname()
LOCK = ".embodyhpc.lock"

HOLD = r"""
import sys, time
from embodyhpc.runlock import RunInUseError, RunLock
run, command, hold_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
start = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
while time.time() < start:
    time.sleep(0.001)
try:
    with RunLock(run, command, shared=command.endswith("eval")):
        print("held", flush=True)
        time.sleep(hold_s)
except RunInUseError as exc:
    print("refused", exc.one_line(), flush=True)
    sys.exit(2)
"""


def hold(run: Path, command: str = "embodyhpc resume", hold_s: float = 60, start: float = 0.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLD, str(run), command, str(hold_s), str(start)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_held(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()
    assert line.strip() == "held", (line, proc.stderr.read() if proc.poll() is not None else "")


def test_a_second_process_is_refused_on_one_line_naming_the_holder(tmp_path):
    holder = hold(tmp_path)
    try:
        wait_held(holder)
        with pytest.raises(RunInUseError) as caught:
            RunLock(tmp_path, "embodyhpc cancel").acquire()
        line = caught.value.one_line()
        assert "\n" not in line
        assert f"in use by `embodyhpc resume` (pid {holder.pid} on {HOST}, since 20" in line, line
        assert line.startswith(str(tmp_path)) and "`embodyhpc cancel` changes nothing" in line
        assert [h.pid for h in holders(tmp_path)] == [holder.pid]
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_that_dies_frees_the_run_and_is_named_no_more(tmp_path):
    holder = hold(tmp_path)
    wait_held(holder)
    holder.kill()  # SIGKILL: no cleanup code runs, the kernel drops the flock with the process
    holder.wait()
    assert holders(tmp_path) == []  # its line is still in the file, but its pid holds nothing
    assert str(holder.pid) in (tmp_path / LOCK).read_text()
    with RunLock(tmp_path, "embodyhpc resume") as lock:
        assert lock.held
        records = [json.loads(line) for line in (tmp_path / LOCK).read_text().splitlines()]
        assert [r["pid"] for r in records] == [os.getpid()]  # the dead holder's line is gone
    assert (tmp_path / LOCK).read_text() == ""  # an exclusive holder leaves no name behind


@pytest.mark.slow
def test_six_processes_started_at_once_exactly_one_holds(tmp_path):
    start = time.time() + 2.0  # every process waits for the same moment, then tries
    procs = [hold(tmp_path, hold_s=3, start=start) for _ in range(6)]
    outputs = [proc.communicate(timeout=60) for proc in procs]
    held = [p for p, (out, _) in zip(procs, outputs, strict=True) if out.startswith("held")]
    refused = [out for out, _ in outputs if out.startswith("refused")]
    assert len(held) == 1 and len(refused) == 5, outputs
    assert all(f"(pid {held[0].pid} on {HOST}" in out for out in refused), refused
    assert sorted(p.returncode for p in procs) == [0, 2, 2, 2, 2, 2]


def test_shared_holders_go_together_and_keep_an_exclusive_one_out(tmp_path):
    evals = [hold(tmp_path, "embodyhpc eval") for _ in range(2)]
    try:
        for proc in evals:
            wait_held(proc)
        with RunLock(tmp_path, "embodyhpc eval", shared=True):
            pass
        with pytest.raises(RunInUseError, match=r"in use by `embodyhpc eval` \(pid \d+ on .* and 1 more"):
            RunLock(tmp_path, "embodyhpc resume").acquire()
    finally:
        for proc in evals:
            proc.kill()
            proc.wait()
    with RunLock(tmp_path, "embodyhpc resume"):
        pass


def test_share_lets_readers_in_and_keeps_writers_out(tmp_path):
    with RunLock(tmp_path, "embodyhpc submit") as lock:
        reader = hold(tmp_path, "embodyhpc eval", hold_s=0)
        assert reader.wait(timeout=60) == 2
        lock.share()
        reader = hold(tmp_path, "embodyhpc eval", hold_s=0)
        assert reader.wait(timeout=60) == 0
        writer = hold(tmp_path, "embodyhpc resume", hold_s=0)
        out, _ = writer.communicate(timeout=60)
        assert writer.returncode == 2 and "in use by `embodyhpc submit`" in out


@pytest.mark.parametrize("tamper", ["symlink", "fifo", "folder"])
def test_a_tampered_lock_file_is_refused_never_followed_or_waited_on(tmp_path, tamper):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me\n")
    run = tmp_path / "run"
    run.mkdir()
    if tamper == "symlink":
        (run / LOCK).symlink_to(victim)
    elif tamper == "fifo":
        os.mkfifo(run / LOCK)
    else:
        (run / LOCK).mkdir()
    for shared in (False, True):
        with pytest.raises(RunDirError) as caught:
            RunLock(run, "embodyhpc resume", shared=shared).acquire()
        assert LOCK in caught.value.one_line() and "(fix: remove it" in caught.value.one_line()
    assert victim.read_text() == "keep me\n"
    assert holders(run) == []  # reading who holds it neither follows nor blocks


def test_lines_someone_wrote_into_the_lock_file_are_not_trusted(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    lines = ["not json", json.dumps([1, 2]), json.dumps({"host": HOST, "pid": "7", "command": "x", "since": "s",
                                                         "mode": "exclusive"}),
             json.dumps({"host": HOST, "pid": dead_pid, "command": "embodyhpc resume", "since": "s",
                         "mode": "exclusive"})]
    (tmp_path / LOCK).write_text("\n".join(lines) + "\n")
    assert holders(tmp_path) == []
    holder = hold(tmp_path, "embodyhpc resume\x1b[31m\nrm -rf /")
    try:
        wait_held(holder)
        with pytest.raises(RunInUseError) as caught:
            RunLock(tmp_path, "embodyhpc cancel").acquire()
        line = caught.value.one_line()
        assert f"pid {holder.pid}" in line and f"pid {dead_pid}" not in line
        assert "\x1b" not in line and "\n" not in line and "embodyhpc resume[31mrm -rf /" in line
    finally:
        holder.kill()
        holder.wait()


def test_a_holder_that_has_not_written_its_line_yet_is_still_refused(tmp_path, monkeypatch):
    import fcntl

    fd = os.open(tmp_path / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, nothing written
        started = time.monotonic()
        with pytest.raises(RunInUseError, match="in use by another process"):
            RunLock(tmp_path, "embodyhpc resume").acquire()
        assert time.monotonic() - started < 5  # it looked for the name a moment, then stopped
    finally:
        os.close(fd)


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch):
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    said = []
    with RunLock(tmp_path, "embodyhpc resume", progress=said.append) as lock:
        assert not lock.held
    assert len(said) == 1 and "has no file locks" in said[0] and "-o flock" in said[0]


def test_a_run_this_user_cannot_write_only_a_reader_may_use(tmp_path, monkeypatch):
    """Someone else's run (0700, or a read-only mount): eval may read it unlocked, a command changing it is refused
    on one line. (Tests run as root here, so the filesystem's refusal is simulated.)"""
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(LOCK) and flags & (os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", read_only)
    with RunLock(tmp_path, "embodyhpc eval", shared=True) as lock:
        assert not lock.held
    with pytest.raises(RunDirError, match="cannot lock the run folder to change it: Permission denied"):
        RunLock(tmp_path, "embodyhpc resume").acquire()
    assert not (tmp_path / LOCK).exists()


def test_nothing_is_made_in_a_folder_that_is_no_run(cli, tmp_path):
    for args in (("resume", str(tmp_path)), ("cancel", str(tmp_path)), ("eval", "--ckpt", str(tmp_path))):
        assert cli(*args).code == 2
    assert list(tmp_path.iterdir()) == []
