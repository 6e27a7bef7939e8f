"""`embodyhpc runs`, training progress in `status`, `status --watch`: real run folders (written as the backends
write them), sacct/squeue doubles on PATH for Slurm runs (the real cluster: tests/slurm/test_runs_slurm.py), real
subprocesses for Ctrl-C and piped output."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from embodyhpc.runlogs import read_last_metrics
from tests.helpers import one_line_error

EXE = str(Path(sys.executable).with_name("embodyhpc"))
ME = f"{socket.gethostname()}:{os.getpid()}"  # a live driver: this test process


def make_run(root: Path, experiment: str, name: str, *, backend: str = "local", driver: str | None = ME,
             steps: int = 100, created: str | None = None, **jobs) -> Path:
    run = root / experiment / name
    for sub in ("submitit", "logs", "eval"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    (run / "resolved.yaml").write_text(f"job:\n  name: x\ntrain:\n  steps: {steps}\n")
    data = {"run_id": name, "run_dir": str(run), "backend": backend, "recipe": "smoke_cpu", "site": None,
            "overrides": [], "python": "python",
            "created": created or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "driver": driver, "jobs": jobs or {"train": {"kind": "train", "job_id": "101", "state": "COMPLETED"}}}
    (run / "run.json").write_text(json.dumps(data))
    return run


def job(kind: str, state: str | None, job_id: str = "101", **more) -> dict:
    return {"kind": kind, "job_id": job_id, "state": state, **more}


def log_steps(run: Path, *steps: int, partial: str = "") -> None:
    with open(run / "logs" / "metrics.jsonl", "a") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 1.0 / step, "step_time_s": 0.5, "tokens_per_s": 2000.0}) + "\n")
        f.write(partial)


def report(run: Path, headline: str = "0.85 [0.71, 0.93] (40/40 episodes)") -> None:
    (run / "eval" / "report.json").write_text(json.dumps(
        {"outcome": "complete", "why": "all shards reported", "headline": {"trained": headline, "expert": "1.00"}}))


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "runs"
    an_hour_ago = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - 3700))
    done = make_run(root, "demo", "demo-20261125-100000", created=an_hour_ago, train=job("train", "COMPLETED"),
                    eval=job("eval", "COMPLETED", "102", array_size=4, array_counts={"COMPLETED": 4}),
                    report=job("report", "COMPLETED", "103"))
    log_steps(done, 50, 100)
    report(done)
    running = make_run(root, "demo", "demo-20261125-110000", train=job("train", "RUNNING"),
                       eval=job("eval", "PENDING", None, array_size=4), report=job("report", "PENDING", None))
    log_steps(running, 10, 20, 30, partial='{"step": 40, "lo')  # training is writing its next line
    make_run(root, "demo", "demo-20261125-120000", driver="some-other-host:1",  # another host's: as recorded
             train=job("train", "RUNNING"))
    gone = make_run(root, "abl", "abl-20261125-090000", driver=f"{socket.gethostname()}:{_dead_pid()}",
                    train=job("train", "RUNNING"), eval=job("eval", "PENDING", None))
    log_steps(gone, 5)
    make_run(root, "abl", "abl-20261125-080000", train=job("train", "FAILED", reason="ValueError: x", exit_code=1),
             eval=job("eval", "CANCELLED", None, array_size=2), report=job("report", "COMPLETED", "104"))
    return root


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def rows(cli, root: Path, *args: str) -> dict[str, dict]:
    result = cli("runs", "--runs-root", str(root), "--json", *args)
    assert result.code == 0, result.err
    return {row["name"]: row for row in json.loads(result.out)["runs"]}


def test_runs_lists_state_steps_success_and_age(cli, root, monkeypatch):
    from embodyhpc import runstate

    created = json.loads((root / "demo" / "demo-20261125-100000" / "run.json").read_text())["created"]
    now = time.mktime(time.strptime(created, "%Y-%m-%dT%H:%M:%S%z")) + 3700  # ages read at a fixed moment
    monkeypatch.setattr(runstate.time, "time", lambda: now)
    found = rows(cli, root)
    assert list(found) == ["demo/demo-20261125-120000", "demo/demo-20261125-110000", "demo/demo-20261125-100000",
                           "abl/abl-20261125-090000", "abl/abl-20261125-080000"]  # newest first
    done = found["demo/demo-20261125-100000"]
    assert (done["state"], done["step"], done["total_steps"]) == ("COMPLETED", 100, 100)
    assert done["success"] == "0.85 [0.71, 0.93] (40/40 episodes)" and 3600 < done["age_s"] < 4000
    running = found["demo/demo-20261125-110000"]
    assert (running["state"], running["job"], running["step"]) == ("RUNNING", "train", 30)  # not the half line
    assert found["demo/demo-20261125-120000"]["state"] == "RUNNING"  # another host's driver: not judged here
    gone = found["abl/abl-20261125-090000"]
    assert gone["state"] == "INTERRUPTED" and "ended before the chain did" in gone["reason"]
    failed = found["abl/abl-20261125-080000"]
    assert (failed["state"], failed["job"], failed["reason"]) == ("FAILED", "train", "ValueError: x")
    monkeypatch.setenv("COLUMNS", "120")  # the full table (a narrow terminal's: tests/test_cli_terminal.py)
    text = cli("runs", "--runs-root", str(root)).out.splitlines()
    assert text[0].split() == ["RUN", "STATE", "STEPS", "SUCCESS", "AGE"]
    assert text[3].split()[:4] == ["demo/demo-20261125-100000", "COMPLETED", "100/100", "0.85"]
    assert text[3].endswith("1h01m") and text[2].split()[1:4] == ["RUNNING", "(train)", "30/100"]


def test_runs_filters(cli, root):
    assert list(rows(cli, root, "--experiment", "abl")) == ["abl/abl-20261125-090000", "abl/abl-20261125-080000"]
    assert list(rows(cli, root, "--state", "running")) == ["demo/demo-20261125-120000", "demo/demo-20261125-110000"]
    assert rows(cli, root, "--experiment", "../demo") == {}  # compared as text, never a path
    one_line_error(cli("runs", "--runs-root", str(root), "--state", "BOGUS"), "--state", "RUNNING")
    empty = cli("runs", "--runs-root", str(root / "nowhere"))
    assert empty.code == 0 and empty.out == "no runs\n"


def test_damaged_and_hostile_run_folders(cli, root, tmp_path):
    half = make_run(root, "demo", "demo-20261126-000000")
    (half / "run.json").write_text('{"run_id": "demo-2026112')  # half-written
    (root / "demo" / "no-json-20261126-010000" / "logs").mkdir(parents=True)  # submit died before run.json
    outside = make_run(tmp_path / "elsewhere", "x", "x-20991231-000000")
    (root / "demo" / "link-20991231-000000").symlink_to(outside)  # a symlink out of the root
    (root / "linked-exp").symlink_to(outside.parent)
    escape = make_run(root, "demo", "demo-20261126-020000", train=job("train", "RUNNING\x1b[2J"))
    assert escape.is_dir()
    found = rows(cli, root)
    assert found["demo/demo-20261126-000000"]["state"] == "DAMAGED"
    assert "not valid JSON" in found["demo/demo-20261126-000000"]["reason"]
    assert found["demo/demo-20261126-020000"]["state"] == "DAMAGED"  # control characters refused
    assert not any("no-json" in name or "x-2099" in name or "link" in name for name in found)
    make_run(root, "demo", "evil\x1b[2J-20261126-030000")  # an escape sequence in a folder name
    text = cli("runs", "--runs-root", str(root))
    assert text.code == 0 and "\x1b" not in text.out and "demo/demo-20261126-000000: " in text.out
    assert "demo/evil?[2J-20261126-030000" in text.out
    (tmp_path / "a-file").write_text("x")
    one_line_error(cli("runs", "--runs-root", str(tmp_path / "a-file")), "is a file")


def test_status_shows_training_progress(cli, root):
    run = root / "demo" / "demo-20261125-110000"
    text = cli("status", "demo-20261125-110000", "--runs-root", str(root)).out
    assert "training: step 30/100 (30%), loss 0.03333, 0.5 s/step, 2000 tokens/s, ETA 35s" in text
    data = json.loads(cli("status", str(run), "--json").out)
    assert data["state"] == "RUNNING" and data["state_of"] == "train"
    assert data["progress"]["step"] == 30 and data["progress"]["eta_s"] == 35.0
    done = cli("status", "demo-20261125-100000", "--runs-root", str(root)).out
    assert "training: step 100/100 (100%)" in done and "ETA" not in done  # no ETA once training ended


def test_status_of_an_interrupted_local_run(cli, root):
    data = json.loads(cli("status", "abl-20261125-090000", "--runs-root", str(root), "--json").out)
    assert [j["state"] for j in data["jobs"]] == ["INTERRUPTED", "INTERRUPTED"]


def test_a_live_resumed_local_run_is_running_not_interrupted(cli, tmp_path):
    """A local run submitted days ago and resumed now: its driver (this process) started after the first attempt
    was created, before the resumed one was; the newest attempt's time is what the driver is judged by."""
    from embodyhpc.runinfo import JobRecord, RunInfo

    root = tmp_path / "runs"
    days_ago = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - 10 * 86400))
    run = make_run(root, "demo", "demo-20261115-100000", created=days_ago, train=job("train", "FAILED"))
    info = RunInfo.load(run)
    info.start_attempt(backend="local", site=None, python="python", overrides=["train.steps=200"],
                       resumed_from_step=100, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    info.driver = ME  # what backend_local records: the resume's process, alive
    info.jobs = {"train": JobRecord("train", job_id="555", state="RUNNING")}
    info.save()
    row = rows(cli, root)["demo/demo-20261115-100000"]
    assert (row["state"], row["job"], row["reason"]) == ("RUNNING", "train", None)
    data = json.loads(cli("status", str(run), "--json").out)
    assert data["state"] == "RUNNING" and [j["state"] for j in data["jobs"]] == ["RUNNING"]


def test_latest_is_the_newest_of_runs_made_in_one_second(cli, tmp_path, monkeypatch):
    """Folders made in the same second get -1, -2, ... -10 (rundir.new_run_dir); `latest` and the listing follow
    that order, numerically (-10 after -9)."""
    from types import SimpleNamespace

    from embodyhpc import rundir
    from embodyhpc.submit import find_run

    root = tmp_path / "runs"
    with monkeypatch.context() as frozen:
        frozen.setattr(rundir, "time", SimpleNamespace(strftime=lambda fmt: "20261125-180000"))
        made = [rundir.new_run_dir(str(root), "demo", "demo") for _ in range(12)]
    assert [p.name for p in made[:3]] == ["demo-20261125-180000", "demo-20261125-180000-1",
                                          "demo-20261125-180000-2"] and made[-1].name.endswith("-11")
    for path in made:
        make_run(root, "demo", path.name)
    assert find_run("latest", root) == made[-1]
    assert list(rows(cli, root)) == [f"demo/{p.name}" for p in reversed(made)]
    assert json.loads(cli("status", "latest", "--runs-root", str(root), "--json").out)["run_dir"] == str(made[-1])


@pytest.mark.parametrize("content", [b"", b"\n\n", b"not json\n", b'{"step": "7"}\n', b'{"step": -1}\n',
                                     b'{"step": NaN}\n', b"[1, 2]\n", b"\xff\xfe\n", b'{"step": 3, "loss": 0.5}'])
def test_metrics_lines_that_are_not_a_logged_step(tmp_path, content):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_bytes(b'{"step": 2, "loss": 1.0, "note": "x", "ok": true}\n' + content)
    line = read_last_metrics(tmp_path)
    assert line is not None and line.step == 2 and line.values == {"loss": 1.0}


def _bytes_read() -> int:
    """What this process has read through read(2) so far (Linux's /proc/self/io rchar): a count, not a clock."""
    text = Path("/proc/self/io").read_text()
    return int(re.search(r"^rchar: (\d+)$", text, re.M).group(1))


def test_metrics_tail_of_a_long_file_and_a_fifo(tmp_path):
    (tmp_path / "logs").mkdir()
    path = tmp_path / "logs" / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.1}) + "\n" for s in range(1, 200_001)))
    before = _bytes_read()
    assert read_last_metrics(tmp_path).step == 200_000
    assert _bytes_read() - before < path.stat().st_size // 8  # the tail only, not 5 MB of lines
    path.unlink()
    os.mkfifo(path)
    assert read_last_metrics(tmp_path) is None


def _finish(run: Path) -> None:
    """Training reaches its last step and the chain ends with a failed shard (run.json replaced whole, as the
    product writes it: a reader never sees half a file)."""
    log_steps(run, 40, 100)
    data = json.loads((run / "run.json").read_text())
    data["jobs"] = {"train": job("train", "COMPLETED"),
                    "eval": job("eval", "FAILED", "102", array_size=4, array_counts={"COMPLETED": 3, "FAILED": 1})}
    (run / "run.json.tmp").write_text(json.dumps(data))
    os.replace(run / "run.json.tmp", run / "run.json")


def test_watch_prints_lines_until_the_run_ends(cli, root, monkeypatch):
    run = root / "demo" / "demo-20261125-110000"
    looks: list[float] = []

    def between_looks(seconds: float) -> None:  # the run moves on while the watch waits: events, not timing
        looks.append(seconds)
        if len(looks) == 1:
            _finish(run)

    monkeypatch.setattr(time, "sleep", between_looks)
    result = cli("status", str(run), "--watch", "--interval", "0.2")
    assert looks == [0.2]  # one look running, one wait, one look at the end
    assert result.code == 1, result.err  # the chain ended, not completed
    lines = result.out.splitlines()
    watch = [line for line in lines if line[:2].isdigit() and line[2] == ":"]
    assert "RUNNING (train): step 30/100 (30%)" in watch[0] and "ETA 35s" in watch[0]
    assert "FAILED (eval 3/4): step 100/100 (100%)" in watch[-1] and "ETA" not in watch[-1]
    assert len(watch) == len(set(line[9:] for line in watch))  # a line per change, not per look
    assert lines[len(watch)].startswith("run ")  # then the status
    assert "\x1b" not in result.out and "\r" not in result.out


def test_watch_of_a_finished_run_returns_at_once(cli, root, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)  # at once: not one look's interval waited
    result = cli("status", "demo-20261125-100000", "--runs-root", str(root), "--watch", "--json")
    assert result.code == 0 and slept == []
    assert json.loads(result.out)["state"] == "COMPLETED"  # stdout: the JSON alone; the line went to stderr
    assert "COMPLETED" in result.err
    one_line_error(cli("status", "demo-20261125-100000", "--runs-root", str(root), "--watch", "--interval", "0"),
                   "--interval")
    (root / "demo" / "demo-20261125-100000" / "eval" / "report.json").write_text(json.dumps(
        {"outcome": "incomplete", "why": "shard 3 missing", "headline": {}}))
    assert cli("status", "demo-20261125-100000", "--runs-root", str(root), "--watch").code == 1  # as submit would


def test_watch_in_a_real_process_piped_and_interrupted(root):
    """Piped stdout: plain lines, no control characters; Ctrl-C (SIGINT) exits 130 with one line on stderr."""
    run = root / "demo" / "demo-20261125-110000"
    # SIGINT as a terminal delivers it: a suite started in the background of a non-interactive shell inherits it
    # ignored, and a Python started with SIGINT ignored never raises KeyboardInterrupt
    proc = subprocess.Popen([EXE, "status", str(run), "--watch", "--interval", "0.2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert "RUNNING (train): step 30/100" in first and not any(c in first + out for c in "\r\x1b")
    assert err.strip().splitlines() == [f"stopped watching; the run goes on (embodyhpc status {run})"]
    _finish(run)
    done = subprocess.run([EXE, "status", str(run), "--watch", "--interval", "0.2"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "FAILED (eval 3/4)" in done.stdout and "\x1b" not in done.stdout


def test_sacct_answers_for_slurm_runs_in_one_call(cli, tmp_path, monkeypatch):
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text(f'#!/bin/sh\necho "sacct $*" >> {log}\necho "201|RUNNING|0:0|None|n1|00:01:00"\n'
                                   'echo "301|FAILED|1:0|None|n2|00:00:05"\n')
    (bin_dir / "squeue").write_text(f'#!/bin/sh\necho "squeue $*" >> {log}\n')
    for tool in ("sacct", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    root = tmp_path / "runs"
    make_run(root, "s", "a-20261125-100000", backend="slurm", driver=None, train=job("train", None, "201"))
    make_run(root, "s", "b-20261125-100000", backend="slurm", driver=None, train=job("train", None, "301"))
    found = rows(cli, root)
    assert found["s/a-20261125-100000"]["state"] == "RUNNING" and found["s/b-20261125-100000"]["state"] == "FAILED"
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["sacct", "squeue"]  # one of each
    (bin_dir / "sacct").write_text("#!/bin/sh\necho 'sacct: error: Connection refused' >&2\nexit 1\n")
    fallback = json.loads(cli("runs", "--runs-root", str(root), "--json").out)
    assert "Connection refused" in fallback["note"] and {r["state"] for r in fallback["runs"]} == {"UNKNOWN"}


def test_progress_poller_reports_each_new_step(tmp_path, monkeypatch):
    from embodyhpc import submit as submitting

    monkeypatch.setattr(submitting._ProgressPoller, "POLL_S", 0.05)  # submit --local's poller
    run = make_run(tmp_path, "e", "r-20261125-100000", steps=10)
    from embodyhpc import runstate
    from tests.helpers import wait_for

    looks: list[int | None] = []
    real = runstate.train_progress

    def counted(run_dir):
        found = real(run_dir)
        looks.append(found.step if found else None)
        return found

    monkeypatch.setattr(runstate, "train_progress", counted)
    seen: list[int] = []
    with submitting._ProgressPoller(run, lambda p: seen.append(p.step)):
        for step in (1, 2, 2, 3):
            log_steps(run, step)
            written = len(looks)  # two more looks: at least one began after the write (counted, not timed)
            wait_for(lambda written=written: len(looks) >= written + 2, 60, f"the poller to look after step {step}",
                     poll_s=0.01)
    assert seen == [1, 2, 3]


@pytest.mark.slow
def test_submit_local_shows_training_progress_on_stderr(tmp_path):
    """A real local chain (the synthetic stand-in, 2 processes over gloo, paced to at least 6 s of steps on any
    machine, six of submit's 1 s looks): a progress line on stderr while it trains, never on stdout, which holds the
    run's JSON alone."""
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "smoke_cpu.yaml"
    result = subprocess.run([EXE, "submit", str(recipe), "--local", "--json", f"job.runs_root={tmp_path}",
                             "train.steps=300", "data.synthetic_step_s=0.02", "eval.enabled=false"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["backend"] == "local"
    # without an evaluation the report has no success rows to show (it once showed "n/a (0/48 episodes)" for each
    # planned policy)
    report = json.loads((Path(json.loads(result.stdout)["run_dir"]) / "eval" / "report.json").read_text())
    assert (report["outcome"], report["headline"]) == ("complete", {})
    progress = [line for line in result.stderr.splitlines() if line.startswith("train: step ")]
    found = progress and re.match(r"train: step \d+/300 \(\d+%\), loss [\d.]+, ([\d.e-]+) s/step, ETA", progress[0])
    assert found, result.stderr[-2000:]
    # the pace holds: steps start data.synthetic_step_s apart on a schedule (a late step does not bunch the next
    # ones), so a window of n steps lasts at least (n - 1) paces plus one; a busy machine only slows it. 10% is one
    # pace in a 10-step window, what an oversleep of the window's first step can take off (0.0196 was seen in CI)
    assert float(found.group(1)) >= 0.02 * 0.9
    assert "\r" not in result.stderr and "\x1b" not in result.stderr


def test_a_failed_training_shows_its_own_error_where_slurm_knows_an_exit_code(cli, tmp_path, monkeypatch):
    """A Slurm training job that failed (sacct: FAILED, exit 1) shows the one-line error its rank 0 recorded in
    logs/train_result.json (a data worker's failure, which every rank raised), when the record is of that job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\n" + "".join(f'echo "{job_id}|FAILED|1:0|None|n2|00:00:05"\n'
                                                          for job_id in ("301", "302")))
    (bin_dir / "squeue").write_text("#!/bin/sh\n")
    for tool in ("sacct", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    root = tmp_path / "runs"
    error = "DataWorkerError: rank 1, data worker 0: ConfigError: model.action_horizon: the episode has 12 frames"
    for name, job_id, recorded in (("mine-20261125-100000", "301", "301"), ("old-20261125-100000", "302", "17")):
        run = make_run(root, "s", name, backend="slurm", driver=None, train=job("train", None, job_id))
        (run / "logs" / "train_result.json").write_text(json.dumps({"status": "failed", "error": error,
                                                                   "job_id": recorded}))
    found = rows(cli, root)
    assert found["s/mine-20261125-100000"]["state"] == "FAILED"
    assert found["s/mine-20261125-100000"]["reason"] == error
    assert found["s/old-20261125-100000"]["reason"] != error  # an earlier attempt's record is not this job's
    status = cli("status", str(root / "s" / "mine-20261125-100000"))
    assert "rank 1, data worker 0" in status.out + status.err
