"""Help that helps: every command's arguments described and its summary whole, -h and --version, shell completion,
overrides typed the way other tools take them get the key=value hint, --json means JSON on stdout, bars and
progress on stderr, one summary line per command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main
from embodyhpc.cli.main import app
from typer.testing import CliRunner

from cli.live import LiveLine
from tests.helpers import one_line_error

EXE = str(Path(sys.executable).with_name("embodyhpc"))
COMMANDS = [name for name in typer.main.get_command(app).commands]  # type: ignore[attr-defined]
LEAVES = [("recipes", "list"), ("recipes", "show"), ("data", "synth"), ("data", "info"), ("data", "convert")] + [
    (name,) for name in COMMANDS if name not in ("recipes", "data")]


def test_top_level_summaries_are_whole_and_h_works():
    runner = CliRunner()
    for flag in ("-h", "--help"):
        result = runner.invoke(app, [flag])
        assert result.exit_code == 0 and "Commands:" in result.output
    listing = runner.invoke(app, ["-h"]).output.split("Commands:")[1]
    assert "..." not in listing  # click cuts a long first sentence to 45 characters with "..."
    for name in COMMANDS:
        assert re.search(rf"^  {name} +\S", listing, re.M), name
    assert "train.steps=100" in runner.invoke(app, ["-h"]).output  # OVERRIDES explained once, with an example


@pytest.mark.parametrize("path", LEAVES, ids=["-".join(p) for p in LEAVES])
def test_every_argument_is_described(path):
    result = CliRunner().invoke(app, [*path, "-h"])
    assert result.exit_code == 0, result.output
    if "Arguments:" not in result.output:
        return
    section = result.output.split("Arguments:")[1].split("Options:")[0]
    entries = [line for line in section.splitlines() if re.match(r"^  \S", line)]
    assert entries, result.output
    for line in entries:  # NAME, then its help on the same line (not only "[required]")
        assert re.match(r"^  \S+( \S+)? {2,}[A-Z`]", line), (path, line)
    assert "Positional arguments:" not in result.output  # described once, not twice


def test_overrides_help_has_an_example():
    text = CliRunner().invoke(app, ["submit", "-h"]).output
    assert "key=value" in text and "train.steps=100" in text and "RECIPE" in text


def test_version(cli):
    from importlib.metadata import version

    for flag in ("--version", "-V"):
        result = cli(flag)
        assert result.code == 0 and result.out == f"embodyhpc {version('embodyhpc')}\n"


def _under_fish(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`embodyhpc ARGS` as a child of a process named fish: the nearest shell among its parents is fish whatever
    runs the tests (a terminal, xdist's workers, make), so a named shell must win over the detected one."""
    return subprocess.run(["bash", "-c", 'exec -a fish bash -c \'"$@"; exit $?\' fish "$@"', "-", EXE, *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_shell_completion_installs_and_completes(tmp_path):
    """--show-completion / --install-completion take the shell they name (Typer's flags ignored `bash`, printed
    the detected shell's script, and failed with "Shell  not supported." where no shell was among the parents)."""
    script = _under_fish("--show-completion", "bash")
    assert script.returncode == 0, script.stderr
    assert "_embodyhpc_completion()" in script.stdout and "complete -o default -F" in script.stdout  # bash's
    env = {**os.environ, "_EMBODYHPC_COMPLETE": "complete_bash", "COMP_WORDS": "embodyhpc sta", "COMP_CWORD": "1"}
    words = subprocess.run([EXE], capture_output=True, text=True, env=env, timeout=60).stdout.split()
    assert words == ["status", "stage"]
    installed = _under_fish("--install-completion", "bash", env={**os.environ, "HOME": str(tmp_path)})
    assert installed.returncode == 0, installed.stderr
    assert "embodyhpc" in (tmp_path / ".bashrc").read_text() and not (tmp_path / ".config").exists()


def test_completion_without_a_named_shell_detects_then_reads_shell_else_says_how(cli, monkeypatch):
    from embodyhpc.cli import completion

    monkeypatch.setattr(completion, "_detected", lambda: None)  # no shell among the parents
    monkeypatch.setenv("SHELL", "/usr/bin/zsh")
    zsh = cli("--show-completion")
    assert zsh.code == 0 and zsh.out.startswith("#compdef ")  # zsh's script (in-process: another prog name)
    monkeypatch.delenv("SHELL")
    one_line_error(cli("--show-completion"), "--show-completion", "cannot tell which shell",
                   "name it, e.g. --show-completion bash")
    one_line_error(cli("--install-completion", "tcsh"), "shell 'tcsh' has no completion")
    monkeypatch.setattr(completion, "_detected", lambda: "fish")
    assert cli("--show-completion").out.startswith("complete --command ")  # fish's


HINT = "overrides are key=value, e.g. train.steps=100"


@pytest.mark.parametrize("args, fix", [
    (["--train.steps=100"], "write train.steps=100"),                  # LeRobot's habit
    (["--train.steps", "100"], "write train.steps=100"),
    (["-train.steps=5"], "write train.steps=5"),
    (["--resources.nodes=2", "train.steps=1"], "write resources.nodes=2"),
    (["train.steps:100"], "write train.steps=100"),                    # YAML's habit
    (["train.steps:", "100"], "write train.steps=100"),
    (["train.steps", "=", "100"], "write train.steps=100"),           # spaces around '='
    (["train.steps", "=100"], "write train.steps=100"),
    (["train.steps=", "100"], "write train.steps=100"),
    (["train.steps", "100"], "write train.steps=100"),
])
@pytest.mark.parametrize("command", [["validate", "smoke_cpu"], ["submit", "smoke_cpu", "--dry-run"],
                                     ["recipes", "show", "smoke_cpu"]])
def test_overrides_written_another_way_get_the_hint(cli, runs_root, command, args, fix):
    one_line_error(cli(*command, *args), HINT, fix)
    assert list(runs_root.iterdir()) == []


def test_real_overrides_and_options_are_not_mistaken(cli, runs_root):
    ok = cli("validate", "smoke_cpu", "train.steps=100", "job.name=a.b", "--site=local", "data.root=")
    assert ok.code == 0, ok.err
    assert cli("recipes", "show", "smoke_cpu", "site.env={A: 'x:y'}").code == 0
    # not a command that takes overrides: click's own message
    assert cli("runs", "--train.steps=1").code == 2


def test_dry_run_json_is_json_on_stdout(cli, runs_root):
    result = cli("submit", "smoke_cpu", "--dry-run", "--json", f"job.runs_root={runs_root}")
    assert result.code == 0, result.err
    data = json.loads(result.out)
    assert data["dry_run"] is True and [j["kind"] for j in data["jobs"]] == ["train", "eval", "report"]
    assert data["jobs"][1]["sbatch_args"] == ["--dependency=afterok:<train>", "--kill-on-invalid-dep=yes"]
    assert data["jobs"][0]["script"].startswith("#!/bin/bash") and list(runs_root.iterdir()) == []


def test_live_line_on_a_pipe_is_plain_lines_and_on_a_terminal_rewrites(tmp_path):
    class Stream(list):
        def write(self, text):
            self.append(text)

        def flush(self):
            pass

        def isatty(self):
            return False

    piped = Stream()
    line = LiveLine(piped, every_s=0.0)
    for text in ("step 1", "step 1", "step 2\x1b[31m", "a\nb"):
        line.show(text)
    line.close()
    assert "".join(piped) == "step 1\nstep 2?[31m\na b\n"  # once per change, one line each, no escape
    slow = Stream()
    throttled = LiveLine(slow, every_s=3600)
    throttled.show("step 1")
    throttled.show("step 2")
    throttled.show("step 3", force=True)
    assert "".join(slow) == "step 1\nstep 3\n"
    tty = Stream()
    live = LiveLine(tty, tty=True)
    live.show("step 1")
    live.say("train: COMPLETED")
    live.close()
    assert "".join(tty) == "\r\x1b[Kstep 1\r\x1b[Ktrain: COMPLETED\nstep 1\n"


def test_data_synth_piped_keeps_stdout_for_its_summary(tmp_path):
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    result = subprocess.run([EXE, "data", "synth", "--out", str(tmp_path / "d"), "--tasks", "reach-v3", "--episodes",
                             "1", "--cameras", ""], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [result.stdout.strip()] and result.stdout.startswith("wrote 1 episodes")
    assert "reach-v3" in result.stderr  # the bar


def test_stage_prints_one_summary_whose_rate_is_the_bars(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"f{i}.bin").write_bytes(os.urandom(1 << 20))
    result = subprocess.run([EXE, "stage", str(src), str(tmp_path / "dest")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 1 and result.stdout.startswith("staged ")
    assert "staged " not in result.stderr  # the summary once, not again on stderr
    # whatever unit the machine's speed gives (KiB/s to TiB/s): the summary's rate is the bar's, the copy phase's
    # bytes over the copy phase's seconds, not over the whole run
    bar = re.search(r"stage copy: 8.0 MiB, 8/8 files in [\d.]+ s \(([\d.]+ [KMGT]?i?B/s)\)", result.stderr)
    summary = re.search(r"8 files copied \(8.0 MiB at ([\d.]+ [KMGT]?i?B/s)\)", result.stdout)
    assert bar and summary, (result.stdout, result.stderr)
    assert bar.group(1) == summary.group(1)
