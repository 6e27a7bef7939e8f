"""RUN arguments the filesystem refuses: a name longer than a filesystem allows (300 characters), a path longer than
PATH_MAX, a loop of symbolic links, a path through a file, a file, bytes that are not UTF-8. Every command that takes
a RUN (status, logs, cancel, resume, eval --ckpt, export, and runs' --runs-root) answers with one line and exit 2,
never an OSError traceback; a run whose folder name is not UTF-8 prints under a strict UTF-8 terminal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import one_line_error

REPO = Path(__file__).resolve().parents[1]
NOT_UTF8 = os.fsdecode(b"run-\xff\xfe-20261125-170000")  # what sys.argv holds for those bytes


def make_run(root: Path, experiment: str, name: str) -> Path:
    run = root / experiment / name
    (run / "submitit").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({
        "run_id": "r", "run_dir": str(run), "backend": "local", "recipe": "smoke_cpu", "site": None,
        "overrides": [], "python": "python", "created": "2026-11-25T17:00:00+0000",
        "jobs": {"train": {"kind": "train", "job_id": "77", "state": "COMPLETED", "exit_code": 0}}}))
    (run / "submitit" / "77_0_log.out").write_text("hello\n")
    return run


@pytest.fixture
def places(tmp_path) -> dict[str, str]:
    root = tmp_path / "runs"
    make_run(root, "demo", "demo-20261125-170000")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "a-file").write_text("not a run")
    return {
        "a 300-character name": "a" * 300,
        "a 300-character folder in a path": str(tmp_path / ("b" * 300) / "run"),
        "EXPERIMENT/ a 300-character name": "demo/" + "c" * 300,
        "a path past PATH_MAX": str(tmp_path) + ("/" + "d" * 200) * 25,
        "a symbolic link loop": str(tmp_path / "loop"),
        "a path through a loop": str(tmp_path / "loop" / "run"),
        "a path through a file": str(tmp_path / "a-file" / "run"),
        "a file": str(tmp_path / "a-file"),
        "a name that is not UTF-8": NOT_UTF8,
        "a path that is not UTF-8": str(tmp_path / NOT_UTF8),
        "root": str(root),
    }


REFS = ["a 300-character name", "a 300-character folder in a path", "EXPERIMENT/ a 300-character name",
        "a path past PATH_MAX", "a symbolic link loop", "a path through a loop", "a path through a file", "a file",
        "a name that is not UTF-8", "a path that is not UTF-8"]
COMMANDS = {
    "status": lambda ref, out: ["status", ref],
    "status --json": lambda ref, out: ["status", ref, "--json"],
    "logs": lambda ref, out: ["logs", ref],
    "cancel": lambda ref, out: ["cancel", ref],
    "resume": lambda ref, out: ["resume", ref, "--dry-run"],
    "eval --ckpt": lambda ref, out: ["eval", "--ckpt", ref, "--local"],
    "export": lambda ref, out: ["export", ref, "--out", out],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("ref", REFS)
def test_a_run_argument_the_filesystem_refuses_is_one_line(cli, places, tmp_path, command, ref):
    out = tmp_path / "exported"
    result = cli(*COMMANDS[command](places[ref], str(out)), "--runs-root", places["root"]) \
        if command != "export" else cli(*COMMANDS[command](places[ref], str(out)))
    line = one_line_error(result)
    assert len(line) < 700 and "Traceback" not in result.err, line  # a 5000-character path is cut, not echoed
    assert "\udcff" not in line and "\\udc" not in line  # bytes that are not UTF-8 shown as \xff
    assert not out.exists()


@pytest.mark.parametrize("ref, fragment", [
    ("a 300-character name", "300 bytes in one name"),
    ("a 300-character folder in a path", "300 bytes in one name"),
    ("EXPERIMENT/ a 300-character name", "300 bytes in one name"),
    ("a path past PATH_MAX", "a path of more than 4095 bytes"),
    ("a symbolic link loop", "loop of symbolic links"),
    ("a path through a loop", "loop of symbolic links"),
    ("a path through a file", "not an embodyhpc run directory"),
    ("a name that is not UTF-8", "not a run name"),
    ("a path that is not UTF-8", "\\xff\\xfe"),
])
def test_status_says_what_is_wrong_with_the_path(cli, places, ref, fragment):
    one_line_error(cli("status", places[ref], "--runs-root", places["root"]), fragment)


@pytest.mark.parametrize("ref, fragment", [
    ("a 300-character folder in a path", "File name too long"),
    ("a path past PATH_MAX", "File name too long"),
    ("a symbolic link loop", "Too many levels of symbolic links"),
    ("a path through a file", "a part of the path is a file"),
    ("a file", "is a file, not the folder runs are under"),
])
def test_runs_root_the_filesystem_refuses_is_one_line(cli, places, ref, fragment):
    for command in (["runs"], ["status", "latest"], ["logs", "demo-2026"]):
        line = one_line_error(cli(*command, "--runs-root", places[ref]), "runs root", fragment)
        assert len(line) < 700


def test_hostile_entries_in_a_runs_root_are_passed_over(cli, places):
    root = Path(places["root"])
    (root / "demo" / "loop-20261126-000000").symlink_to(root / "demo" / "loop-20261126-000000")
    (root / "demo" / "file-20261126-010000").write_text("x")
    (root / "an-experiment-that-is-a-file").write_text("x")
    (root / "demo" / ("e" * 255)).mkdir()  # the longest name a folder may have: not a run (no run.json)
    found = json.loads(cli("runs", "--runs-root", str(root), "--json").out)
    assert [row["name"] for row in found["runs"]] == ["demo/demo-20261125-170000"] and found["unreadable"] == []
    assert cli("status", "latest", "--runs-root", str(root)).code == 0
    one_line_error(cli("status", "loop-20261126", "--runs-root", str(root)), "no run of that name")


def test_a_run_whose_folder_is_not_utf8_prints_on_a_strict_terminal(tmp_path):
    """en_US.UTF-8 gives Python a strict stdout: a name's undecodable bytes would crash `print`. They come out as
    the bytes they are (as `ls` prints them), in status, logs and runs (where the table shows them as '?')."""
    root = tmp_path / "runs"
    run = make_run(root, "demo", NOT_UTF8)
    commands = [["status", "latest", "--runs-root", str(root)], ["logs", str(run)], ["runs", "--runs-root", str(root)],
                ["status", str(run), "--json"]]
    listing = tmp_path / "commands.json"
    listing.write_text(json.dumps(commands, ensure_ascii=True))  # json escapes the lone surrogates
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "cli_driver.py"), str(listing)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert proc.returncode == 0, proc.stderr
    status, logs, runs, as_json = json.loads(proc.stdout)
    assert [r["code"] for r in (status, logs, runs, as_json)] == [0, 0, 0, 0], (status, logs, runs, as_json)
    shown = "run-\\xff\\xfe-20261125-170000"  # the raw bytes, as the driver decodes them back
    assert f"run {root}/demo/{shown} " in status["out"] and "COMPLETED" in status["out"]
    assert f"{shown}/submitit/77_0_log.out" in logs["out"] and "hello" in logs["out"]
    assert "demo/run-??-20261125-170000" in runs["out"]
    assert json.loads(as_json["out"])["run_dir"] == str(run)


@pytest.mark.parametrize("ref", ["a symbolic link loop", "a file", "a path through a file"])
def test_submit_into_a_runs_root_that_cannot_be_a_folder_is_one_line(cli, places, tmp_path, ref):
    before = sorted(p.name for p in tmp_path.iterdir())
    line = one_line_error(cli("submit", "smoke_cpu", "--local", f"job.runs_root={places[ref]}",
                              "tracking.enabled=false"), "job.runs_root")
    assert "Traceback" not in line and sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created
    assert cli("submit", "smoke_cpu", "--dry-run", f"job.runs_root={places[ref]}").code == 0  # what it would do
