"""Damaged, hostile and moved run folders: `status`, `logs` and `cancel` give one line and exit 2, never a
traceback, and never hand scancel anything but a job id; a moved folder is read where it is; without sacct,
status falls back to the states on disk and says so."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from tests.conftest import DEFAULT_SLURM_CONF

COMMANDS = ("status", "logs", "cancel")


def _valid(run: Path, backend: str = "slurm", **jobs) -> dict:
    return {"run_id": run.name, "run_dir": str(run), "backend": backend, "recipe": "smoke_cpu", "site": "local",
            "overrides": ["train.steps=5"], "python": "/usr/bin/python3", "created": "2026-01-01T00:00:00+0000",
            "jobs": jobs or {"train": {"kind": "train", "job_id": "101"},
                             "eval": {"kind": "eval", "job_id": "102", "array_size": 4,
                                      "dependency": "afterok:101"},
                             "report": {"kind": "report", "job_id": "103", "dependency": "afterany:101:102"}},
            "mlflow_run_id": None}


@pytest.fixture
def slurm_doubles(tmp_path, monkeypatch):
    """sacct, squeue and scancel doubles first on PATH; each call's arguments go to calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for tool in ("sacct", "squeue", "scancel", "sinfo"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\nexit 0\n')
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return log


@pytest.fixture
def no_hang():
    """Fail instead of waiting forever on a FIFO."""
    def alarm(*_):
        raise AssertionError("hung for 20 s")
    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _calls(log: Path, tool: str) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith(tool)] if log.exists() else []


_ATTEMPT = {"number": 1, "created": "2026-01-01T00:00:00+0000", "backend": "slurm", "site": None, "python": "python3",
            "overrides": [], "jobs": {}}


def _with(mutate):
    def write(path: Path) -> None:
        data = _valid(path.parent)
        mutate(data)
        path.write_text(json.dumps(data))
    return write


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def mutate(data):
        target = data
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    return _with(mutate)


def _drop(*keys):
    def mutate(data):
        target = data
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]
    return _with(mutate)


def _text(content: str):
    return lambda path: path.write_text(content)


def _bytes(content: bytes):
    return lambda path: path.write_bytes(content)


def _truncated(path: Path) -> None:
    text = json.dumps(_valid(path.parent))
    path.write_text(text[: len(text) // 2])


def _huge(path: Path) -> None:
    data = _valid(path.parent)
    data["padding"] = "x" * (5 << 20)
    path.write_text(json.dumps(data))


def _directory(path: Path) -> None:
    path.mkdir()


def _symlink_loop(path: Path) -> None:  # a read error (ELOOP) without chmod, which root ignores
    path.symlink_to(path.name)


def _dangling(path: Path) -> None:
    path.symlink_to(path.parent / "gone.json")


def _fifo(path: Path) -> None:  # reading it would wait for a writer forever
    os.mkfifo(path)


def _device(path: Path) -> None:  # reading it would never end
    path.symlink_to("/dev/zero")


CORRUPTIONS = {
    "fifo": _fifo,
    "device": _device,
    "empty": _text(""),
    "whitespace": _text(" \n\t\n"),
    "truncated": _truncated,
    "garbage": _text("this is not json at all }{"),
    "list": _text("[1, 2, 3]"),
    "string": _text('"run"'),
    "null": _text("null"),
    "number": _text("42"),
    "binary": _bytes(bytes(range(256)) * 4),
    "utf16": _bytes(json.dumps({"backend": "slurm"}).encode("utf-16")),
    "nul_bytes": _bytes(b"\x00" * 64),
    "deep_nesting": _text("[" * 100_000 + "]" * 100_000),
    "huge": _huge,
    "directory": _directory,
    "symlink_loop": _symlink_loop,
    "dangling_symlink": _dangling,
    "null_backend": _set("backend", None),
    "null_jobs": _set("jobs", None),
    "null_job": _set("jobs", "train", None),
    "null_kind": _set("jobs", "train", "kind", None),
    "null_recipe": _set("recipe", None),
    "missing_backend": _drop("backend"),
    "missing_jobs": _drop("jobs"),
    "missing_kind": _drop("jobs", "train", "kind"),
    "missing_run_id": _drop("run_id"),
    "jobs_a_list": _set("jobs", [1, 2]),
    "job_a_string": _set("jobs", "train", "train"),
    "array_size_a_string": _set("jobs", "eval", "array_size", "4"),
    "array_size_a_bool": _set("jobs", "eval", "array_size", True),
    "array_size_negative": _set("jobs", "eval", "array_size", -4),
    "array_size_huge": _set("jobs", "eval", "array_size", 10 ** 30),
    "exit_code_a_float": _set("jobs", "train", "exit_code", 1.5),
    "exit_code_nan": lambda path: path.write_text(json.dumps(_valid(path.parent)).replace(
        '"job_id": "101"', '"job_id": "101", "exit_code": NaN')),
    "counts_negative": _set("jobs", "eval", "array_counts", {"COMPLETED": -1}),
    "element_ids_numbers": _set("jobs", "eval", "element_ids", [1, 2]),
    "overrides_a_string": _set("overrides", "train.steps=5"),
    "backend_unknown": _set("backend", "kubernetes"),
    "state_with_escape": _set("jobs", "train", "state", "\x1b]0;owned\x07RUNNING"),
    "kind_with_newline": _set("jobs", "train", "kind", "train\nFAKE LINE"),
    "job_id_traversal": _set("jobs", "train", "job_id", "../../../etc/passwd"),
    "job_id_glob": _set("jobs", "train", "job_id", "*"),
    "job_id_a_number": _set("jobs", "train", "job_id", 101),
    "job_id_flag": _set("jobs", "train", "job_id", "--user=root"),
    "job_id_endless_digits": _set("jobs", "train", "job_id", "9" * 5000),
    "100k_job_records": _set("jobs", {f"j{i}": {"kind": "train", "job_id": str(i)} for i in range(100_000)}),
    # versions and attempts count from 1, and the attempts run.json lists are 1 .. attempt - 1: a resume would
    # otherwise archive into (and overwrite) an attempt's folder that is not the newest
    "schema_version_zero": _set("schema_version", 0),
    "attempt_zero": _set("attempt", 0),
    "attempt_without_its_history": _set("attempt", 3),
    "attempts_numbered_twice": _with(lambda data: data.update(attempt=3, attempts=[_ATTEMPT, _ATTEMPT])),
    "attempt_number_zero": _with(lambda data: data.update(attempt=2, attempts=[{**_ATTEMPT, "number": 0}])),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_damaged_run_json_is_one_line_with_exit_2(cli, tmp_path, slurm_doubles, no_hang, corruption, command):
    run = tmp_path / "run"
    run.mkdir()
    CORRUPTIONS[corruption](run / "run.json")
    result = cli(command, str(run))
    assert result.code == 2, (result.out, result.err)
    assert len(result.err.strip().splitlines()) == 1 and "Traceback" not in result.err + result.out
    assert str(run / "run.json") in result.err and "fix:" in result.err
    assert "\x1b" not in result.err and "owned" not in result.err  # nothing of the content is echoed
    assert _calls(slurm_doubles, "scancel") == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 file; the symlink-loop case covers read errors")
def test_an_unreadable_run_json_is_one_line_with_exit_2(cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(_valid(run)))
    (run / "run.json").chmod(0)
    for command in COMMANDS:
        result = cli(command, str(run))
        assert result.code == 2 and "cannot read run.json" in result.err, command


def test_a_run_json_that_refuses_reading_is_one_line_with_exit_2(cli, tmp_path, monkeypatch, slurm_doubles):
    """chmod 000 as root, emulated: opening run.json raises EACCES."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(_valid(run)))
    real_open = Path.open

    def refusing_open(self, *args, **kwargs):
        if self.name == "run.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refusing_open)
    for command in COMMANDS:
        result = cli(command, str(run))
        assert result.code == 2 and "cannot read run.json: Permission denied" in result.err, (command, result.err)
        assert len(result.err.strip().splitlines()) == 1 and str(run / "run.json") in result.err
    assert _calls(slurm_doubles, "scancel") == []


def test_keys_a_newer_version_wrote_are_ignored(cli, tmp_path, slurm_doubles):
    run = tmp_path / "run"
    run.mkdir()
    data = _valid(run, backend="local", train={"kind": "train", "job_id": "7", "state": "COMPLETED",
                                               "exit_code": 0, "future_field": [1]})
    data["schema_version"] = 9
    (run / "run.json").write_text(json.dumps(data))
    for command in COMMANDS:
        result = cli(command, str(run))
        assert result.code == 0, (command, result.err)
    assert "COMPLETED" in cli("status", str(run)).out


def _moved_local_run(tmp_path: Path) -> tuple[Path, Path]:
    """A local run with logs and an evaluation while training, written at `old`, then moved to `new`."""
    old = tmp_path / "old" / "run"
    (old / "submitit").mkdir(parents=True)
    (old / "run.json").write_text(json.dumps(_valid(old, backend="local", train={
        "kind": "train", "job_id": "77", "state": "COMPLETED", "exit_code": 0})))
    lines = [f"line {i}" for i in range(1000)]
    (old / "submitit" / "77_0_log.out").write_text("\n".join(lines))  # the last line has no newline
    (old / "submitit" / "77_1_log.err").write_text("rank 1 says hi\n")
    step = old / "evals" / "step-2"
    step.mkdir(parents=True)
    sub = _valid(step, backend="local", eval={"kind": "eval", "job_id": "80", "state": "COMPLETED",
                                              "array_size": 2, "array_counts": {"COMPLETED": 2}})
    sub["parent_run"] = str(old)
    (step / "run.json").write_text(json.dumps(sub))
    new = tmp_path / "elsewhere" / "moved-run"
    new.parent.mkdir()
    shutil.move(str(old), str(new))
    return old, new


def test_a_moved_run_folder_is_read_where_it_is(cli, tmp_path):
    from embodyhpc.runinfo import RunInfo

    old, new = _moved_local_run(tmp_path)
    status = cli("status", str(new))
    assert status.code == 0 and str(new) in status.out and str(old) not in status.out
    assert "step-2: eval COMPLETED (2/2 done)" in status.out
    logs = cli("logs", str(new))
    assert logs.code == 0 and str(old) not in logs.out
    printed = [line for line in logs.out.splitlines() if line.startswith("line ")]
    assert printed == [f"line {i}" for i in range(1000)] and "rank 1 says hi" in logs.out
    followed = cli("logs", str(new), "-f")
    assert followed.code == 0 and followed.out.count("[train task 0 out] line ") == 1000
    assert RunInfo.load(new / "evals" / "step-2").parent_run == str(new)


def test_follow_prints_a_line_written_in_two_parts_once_and_whole(tmp_path):
    from embodyhpc.runlogs import follow

    log = tmp_path / "1_0_log.out"
    log.write_bytes(b"first\nhalf a ")
    rounds = iter([False, False, True])
    writes = iter([b"", b"line, caf\xc3", b"\xa9\ntail"])

    def paths():
        with log.open("ab") as f:
            f.write(next(writes))
        return [("train", log)]

    lines = list(follow(paths, lambda: next(rounds), poll_s=0))
    assert lines == ["[train] first", "[train] half a line, café", "[train] tail"]


def _sacct_fails(bin_dir: Path, log: Path) -> None:
    (bin_dir / "sacct").write_text(
        f'#!/bin/sh\necho "sacct $*" >> {log}\n'
        'echo "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent connection" >&2\n'
        'echo "sacct: error: Problem talking to the database: Connection refused" >&2\nexit 1\n')


def test_status_without_sacct_falls_back_to_the_states_on_disk(cli, tmp_path, slurm_doubles):
    _sacct_fails(slurm_doubles.parent / "bin", slurm_doubles)
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(_valid(run)))
    text = cli("status", str(run))
    assert text.code == 0, text.err
    assert "come from disk" in text.out and "Connection refused" in text.out and "sacct: error" not in text.out
    assert "Traceback" not in text.err and _calls(slurm_doubles, "squeue") == []  # no 18 s squeue retry
    lines = text.out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["JOB", "ID", "STATE"])
    assert [line.split()[2] for line in lines[header + 1:header + 4]] == ["UNKNOWN"] * 3
    (run / "eval" / "report.json").write_text(json.dumps({
        "outcome": "train_failed", "why": "training did not finish", "train": {"state": "FAILED"},
        "eval": {"state": "CANCELLED"}, "headline": {}}))
    data = json.loads(cli("status", str(run), "--json").out)
    assert data["states_from"] == "disk" and "come from disk" in data["note"]
    assert [j["state"] for j in data["jobs"]] == ["FAILED", "CANCELLED", "COMPLETED"]


@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")  # one worker: the cluster has 2 nodes
def test_status_against_a_dead_controller_reads_the_disk(cli, tmp_path, slurm_cluster, monkeypatch):
    conf = Path(slurm_cluster or DEFAULT_SLURM_CONF).read_text()
    dead = tmp_path / "slurm.conf"  # the same cluster, with nothing listening on its ports
    dead.write_text(conf.replace("AccountingStoragePort=6819", "AccountingStoragePort=9").replace(
        "SlurmctldPort=6817", "SlurmctldPort=9"))
    monkeypatch.setenv("SLURM_CONF", str(dead))
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(_valid(run)))
    result = cli("status", str(run))
    assert result.code == 0 and "come from disk" in result.out, result.err
    assert len([line for line in result.out.splitlines() if "error" in line]) <= 1


def test_a_damaged_report_or_evaluation_costs_its_own_line(cli, tmp_path):
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(_valid(run, backend="local", train={
        "kind": "train", "job_id": "7", "state": "COMPLETED"})))
    (run / "eval" / "report.json").write_bytes(b"\xff\xfe{")
    (run / "evals" / "step-4").mkdir(parents=True)
    (run / "evals" / "step-4" / "run.json").write_text("[]")
    result = cli("status", str(run))
    assert result.code == 0 and "report: unreadable" in result.out, result.err
    assert "step-4:" in result.out and "damaged run.json" in result.out


HOSTILE_IDS = ["9" * 21, "--user=root", "-1", "1;rm -rf ~", "1 2", "", " 1", "1\n2", "1_", "_1", "1_2_3", "1.0", "0x10",
               "１２", "12abc", "*", "$(id)", "1,2", "-u", "1_[0-3]", "--signal=KILL"]


@pytest.mark.parametrize("job_id", HOSTILE_IDS)
def test_scancel_gets_only_job_ids(slurm_doubles, job_id):
    from embodyhpc.errors import UserError
    from embodyhpc.slurm import commands

    with pytest.raises(UserError) as caught:
        commands.cancel(["5", job_id])
    assert "scancel" in caught.value.one_line() and "\n" not in caught.value.one_line()
    assert _calls(slurm_doubles, "scancel") == []


@pytest.mark.parametrize("job_id", HOSTILE_IDS)
def test_cancel_refuses_a_run_json_with_a_hostile_job_id(cli, tmp_path, slurm_doubles, job_id):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(_valid(run, eval={"kind": "eval", "job_id": "5", "array_size": 2,
                                                               "element_ids": ["5", job_id]})))
    result = cli("cancel", str(run))
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1 and "jobs.eval" in result.err
    assert _calls(slurm_doubles, "scancel") == []


def test_cancel_stops_the_evaluation_chains_started_during_training(cli, tmp_path, slurm_doubles):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(_valid(run)))
    for step, first in (("step-200", 300), ("step-100", 200)):
        sub = run / "evals" / step
        sub.mkdir(parents=True)
        data = _valid(sub, export={"kind": "export", "job_id": str(first)},
                      eval={"kind": "eval", "job_id": str(first + 1), "array_size": 4},
                      report={"kind": "report", "job_id": str(first + 2)})
        data["parent_run"] = str(run)
        (sub / "run.json").write_text(json.dumps(data))
    (run / "evals" / "step-300").mkdir()  # asked for, run.json not written yet: nothing submitted
    result = cli("cancel", str(run))
    assert result.code == 0, result.err
    assert _calls(slurm_doubles, "scancel") == ["scancel 101 102 103", "scancel 200 201 202", "scancel 300 301 302"]
    assert "step-100" in result.out and "step-200" in result.out


def test_cancel_cancels_what_it_can_when_an_evaluation_folder_is_damaged(cli, tmp_path, slurm_doubles):
    run = tmp_path / "run"
    (run / "evals" / "step-100").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(_valid(run)))
    (run / "evals" / "step-100" / "run.json").write_text('{"backend": "slurm", "jobs": {"eval": {"kind": "ev')
    result = cli("cancel", str(run))
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1
    assert "step-100" in result.err and "not cancelled" in result.err
    assert _calls(slurm_doubles, "scancel") == ["scancel 101 102 103"]


def test_fifos_where_logs_and_reports_belong_are_skipped_not_waited_on(cli, tmp_path, no_hang):
    run = tmp_path / "run"
    for sub in ("submitit", "eval"):
        (run / sub).mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(_valid(run, backend="local", train={
        "kind": "train", "job_id": "7", "state": "COMPLETED"})))
    os.mkfifo(run / "eval" / "report.json")
    os.mkfifo(run / "submitit" / "7_0_log.out")
    (run / "submitit" / "7_0_log.err").write_text("the real log\n")
    status = cli("status", str(run))
    assert status.code == 0 and "report: unreadable" in status.out, status.err
    logs = cli("logs", str(run))
    assert logs.code == 0 and "the real log" in logs.out


def test_sacct_rows_with_an_empty_state_read_as_unknown(cli, tmp_path, slurm_doubles):
    (slurm_doubles.parent / "bin" / "sacct").write_text("#!/bin/sh\necho '101||0:0|None||'\necho '102'\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(_valid(run)))
    result = cli("status", str(run))
    assert result.code == 0 and "Traceback" not in result.err, result.err
    assert result.out.splitlines()[2].split()[:3] == ["train", "101", "UNKNOWN"]


@pytest.mark.parametrize("where", ["nonexistent", "a_file", "empty_folder"])
def test_not_a_run_folder_is_one_line_with_exit_2(cli, tmp_path, where):
    path = tmp_path / where
    if where == "a_file":
        path.write_text("x")
    elif where == "empty_folder":
        path.mkdir()
    for command in COMMANDS:
        result = cli(command, str(path))
        assert result.code == 2 and "no run.json" in result.err and len(result.err.strip().splitlines()) == 1


def test_logs_follow_without_sacct_prints_everything_then_stops_with_one_line(cli, tmp_path, slurm_doubles, no_hang):
    _sacct_fails(slurm_doubles.parent / "bin", slurm_doubles)
    run = tmp_path / "run"
    (run / "submitit").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps(_valid(run)))
    (run / "submitit" / "101_0_log.out").write_text("step 1\nstep 2\n")
    result = cli("logs", str(run), "-f")
    assert result.code == 1 and "[train task 0 out] step 2" in result.out
    assert len(result.err.strip().splitlines()) == 1 and "stopped following" in result.err
    assert "Connection refused" in result.err and "Traceback" not in result.err


def test_run_json_carries_its_schema_version_and_an_older_one_still_reads(tmp_path):
    """New files say which layout they use; a file from before the version existed reads as version 1, and saving
    it again writes the current version (with every known field)."""
    from embodyhpc.rundir import RUN_JSON_VERSION
    from embodyhpc.runinfo import RunInfo

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(_valid(run)))
    info = RunInfo.load(run)
    assert info.schema_version == 1 and info.jobs["eval"].array_size == 4
    info.save()
    saved = json.loads((run / "run.json").read_text())
    assert saved["schema_version"] == RUN_JSON_VERSION >= 2 and saved["jobs"]["eval"]["dependency"] == "afterok:101"
    assert RunInfo.load(run).schema_version == RUN_JSON_VERSION


def test_a_newer_schema_version_with_new_fields_reads_and_a_wrong_type_is_refused(tmp_path):
    from embodyhpc.errors import RunDirError
    from embodyhpc.runinfo import RunInfo

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({**_valid(run), "schema_version": 99, "queue": {"new": True}}))
    assert RunInfo.load(run).schema_version == 99  # readers ignore what they do not know
    (run / "run.json").write_text(json.dumps({**_valid(run), "schema_version": "2"}))
    with pytest.raises(RunDirError, match="schema_version"):
        RunInfo.load(run)


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temp_file(tmp_path):
    from embodyhpc.atomic import replace_atomically, write_json_atomic

    path = tmp_path / "report.json"
    write_json_atomic(path, {"outcome": "complete"})

    def torn(tmp: Path) -> None:
        tmp.write_text('{"outcome": "par')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_atomically(path, torn)
    assert json.loads(path.read_text()) == {"outcome": "complete"} and os.listdir(tmp_path) == ["report.json"]
    write_json_atomic(path, {"outcome": "failed"}, durable=True)
    assert json.loads(path.read_text()) == {"outcome": "failed"} and os.listdir(tmp_path) == ["report.json"]
    assert path.stat().st_mode & 0o777 == 0o600  # a run's files are private, as the run folder is


def test_attempts_numbered_as_resume_records_them_read_back(tmp_path):
    from embodyhpc.runinfo import RunInfo

    run = tmp_path / "run"
    run.mkdir()
    attempts = [{**_ATTEMPT, "number": n} for n in (1, 2)]
    (run / "run.json").write_text(json.dumps({**_valid(run), "attempt": 3, "attempts": attempts}))
    assert [a.number for a in RunInfo.load(run).all_attempts()] == [1, 2, 3]


def test_write_private_replaces_whole_never_through_a_link_and_stays_private(tmp_path, monkeypatch):
    """resolved.yaml and scripts: a reader (a job, `eval --ckpt`) sees the old text or the new, never half; a
    symlink put where one belongs is replaced, its target untouched."""
    from embodyhpc.rundir import write_private

    path = tmp_path / "resolved.yaml"
    write_private(path, "old: 1\n")
    real_write = Path.write_text

    def torn(self, text, *args, **kwargs):
        real_write(self, text[:3], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(OSError, match="No space"):
        write_private(path, "new: 2\n")
    monkeypatch.undo()
    assert path.read_text() == "old: 1\n" and os.listdir(tmp_path) == ["resolved.yaml"]
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    path.unlink()
    path.symlink_to(victim)
    write_private(path, "new: 2\n")
    assert victim.read_text() == "keep\n" and not path.is_symlink() and path.read_text() == "new: 2\n"
    assert path.stat().st_mode & 0o777 == 0o600
