"""The README's commands run as written.

Every command line in the README's ```bash blocks is either run here (through the real entry point, with its
placeholders filled in and its [optional] parts left out) or skipped by a named rule saying why it needs a
cluster, a GPU, a run directory or minutes; the skipped list must stay small.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

# (pattern on the command, why it cannot run here); each must match at least one README command
SKIP_RULES = {
    r"^make (demo|test)\b": "the whole demo / test suite: minutes, and the suite itself",
    r"^embodyhpc smoke recipes/": "trains on a GPU node, or submits to a cluster (--submit)",
    r"^embodyhpc smoke +\[RECIPE\]": "trains every GPU path of this node (about 50 s on CPU)",
    r"^embodyhpc (eval|export|status|logs|cancel|resume) ": "needs the run directory of a submitted run",
    r"^tools/nccl_sweep\.sh": "runs NCCL across cluster nodes",
}
MAX_SKIPPED = 12


def readme_commands() -> list[str]:
    """Command lines of the ```bash blocks, comments removed."""
    commands, in_bash = [], False
    for line in README.read_text().splitlines():
        if line.startswith("```"):
            in_bash = line.strip() == "```bash" and not in_bash
            continue
        if in_bash:
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


def _skip_reason(command: str) -> str | None:
    return next((why for pattern, why in SKIP_RULES.items() if re.search(pattern, command)), None)


def _runnable(command: str, tmp_path: Path) -> list[str]:
    """The command as it runs here: [optional] parts dropped, placeholders filled, small sizes where it generates."""
    command = re.sub(r"\s*\[[^\]]*\]", "", command)
    args = shlex.split(command)
    assert args[0] == "embodyhpc", command
    args = args[1:]
    fill = {"DIR": str(tmp_path / "synth"), "SRC": str(tmp_path / "src"), "DEST": str(tmp_path / "dest"),
            "DST": str(tmp_path / "dst")}
    args = [fill.get(a, a) for a in args]
    if args[0] == "submit":  # its comment offers --dry-run: the real submission needs the cluster or minutes
        args.append("--dry-run")
    if args[:2] == ["data", "synth"]:
        args += ["--tasks", "reach-v3", "--episodes", "1", "--cameras", ""]
    if args[0] == "doctor":
        args += ["--json", "--probe-mb", "0"]
    if args[:2] == ["data", "convert"]:  # the LeRobot v2.1 dataset LeRobot 0.3.3 wrote (tests/data/fixtures)
        shutil.copytree(README.parent / "tests" / "data" / "fixtures" / "lerobot_v21_sample", tmp_path / "src")
    if args[0] == "stage":
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "episode.bin").write_bytes(b"x" * 4096)
        args.append("--quiet")
    return args


def test_readme_lists_commands():
    commands = readme_commands()
    assert any(c.startswith("embodyhpc validate recipes/pi05_fp8.yaml --site example_ib") for c in commands)
    assert len(commands) >= 15, commands


def test_skipped_commands_are_few_and_named():
    commands = readme_commands()
    skipped = [c for c in commands if _skip_reason(c)]
    assert len(skipped) <= MAX_SKIPPED, skipped
    for pattern in SKIP_RULES:  # a rule that matches nothing is stale: the README changed
        assert any(re.search(pattern, c) for c in commands), pattern


RUNNABLE = [c for c in readme_commands() if not _skip_reason(c)]


@pytest.mark.parametrize("command", RUNNABLE, ids=[c[:60] for c in RUNNABLE])
def test_readme_command_runs(cli, tmp_path, monkeypatch, command):
    # from a folder of one's own, as a user would: the repo's recipes, and (for the demo recipe) the demo data
    # `make demo` records first, here one short episode
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(README.parent / "recipes")
    args = _runnable(command, tmp_path)
    if "demo_metaworld_cpu" in command:
        # with a camera (16 px): validate reads the dataset and pi0.5 needs one (validation/data_checks.py)
        made = cli("data", "synth", "--out", "runs/demo-data/metaworld-mt4", "--tasks", "reach-v3", "--episodes", "1",
                   "--image-size", "16")
        assert made.code == 0, made.err
    result = cli(*args)
    assert result.code == 0, (command, args, result.err[-2000:])
    assert not any(line.startswith("error") for line in result.err.splitlines()), result.err
    if args[0] == "doctor":
        assert json.loads(result.out)["checks"]
    if args[:2] == ["data", "synth"]:
        assert (tmp_path / "synth" / "meta" / "info.json").is_file()
    if args[0] == "stage":
        assert (tmp_path / "dest" / "episode.bin").read_bytes() == b"x" * 4096
    if args[:2] == ["data", "convert"]:
        assert json.loads((tmp_path / "dst" / "meta" / "info.json").read_text())["codebase_version"] == "v3.0"
    if args[0] in ("validate", "render", "submit") and "pi05" in command:
        # the README's data.root is a cluster path: named in a warning, never an error
        assert "warning: data.root=/lustre/data/pick" in result.err
