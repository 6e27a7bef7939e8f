"""RUN arguments given as a name or `latest` (submit.find_run, submit.find_run_dir): every command that takes a
run folder accepts them; unknown, ambiguous and hostile names are one line with exit 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from embodyhpc.errors import RunDirError
from embodyhpc.runstate import run_folders
from embodyhpc.submit import find_run
from tests.helpers import one_line_error


def make_run(root: Path, experiment: str, name: str, *, state: str = "COMPLETED", backend: str = "local") -> Path:
    run = root / experiment / name
    (run / "submitit").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({
        "run_id": name, "run_dir": str(run), "backend": backend, "recipe": "smoke_cpu", "site": None,
        "overrides": [], "python": "python", "created": "2026-11-25T17:00:00+0000",
        "jobs": {"train": {"kind": "train", "job_id": "77", "state": state, "exit_code": 0}}}))
    return run


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "runs"
    make_run(root, "demo", "demo-metaworld-20261125-170000")
    make_run(root, "demo", "demo-metaworld-20261125-180000")
    make_run(root, "other", "smoke-20261124-090000")
    (root / "demo-data" / "metaworld-mt4" / "meta").mkdir(parents=True)  # a dataset kept beside the runs
    (root / "demo" / "half-made-20261126-000000" / "submitit").mkdir(parents=True)  # no run.json: not a run
    return root


def test_latest_is_the_newest_by_the_stamp_in_its_name(root):
    # run.json of the older run rewritten last (a state change) does not make it the latest
    os.utime(root / "demo" / "demo-metaworld-20261125-170000" / "run.json")
    assert find_run("latest", root) == root / "demo" / "demo-metaworld-20261125-180000"
    assert [p.name for p in run_folders(root)] == ["demo-metaworld-20261125-180000",
                                                   "demo-metaworld-20261125-170000", "smoke-20261124-090000"]


def test_names_prefixes_and_experiment_slash_name(root):
    assert find_run("smoke-20261124-090000", root) == root / "other" / "smoke-20261124-090000"
    assert find_run("smoke", root) == root / "other" / "smoke-20261124-090000"  # a unique start
    assert find_run("demo/demo-metaworld-20261125-170000", root) == root / "demo" / "demo-metaworld-20261125-170000"
    made = make_run(root, "other", "demo-metaworld-20261125-170000")  # the same name in two experiments
    with pytest.raises(RunDirError, match="2 runs under .* match"):
        find_run("demo-metaworld-20261125-170000", root)
    assert find_run("other/demo-metaworld-20261125-170000", root) == made


@pytest.mark.parametrize("ref, fragment", [
    ("demo-metaworld", "2 runs under"),                     # ambiguous
    ("demo-metawrld-20261125-180000", "nearest: demo/demo-metaworld-20261125-180000"),  # a typo
    ("half-made-20261126-000000", "no run of that name"),   # a folder without run.json is no run
    ("metaworld-mt4", "no run of that name"),                # a dataset folder is no run
    ("demo-*", "not a run name"), ("demo?", "not a run name"), ("[d]emo", "not a run name"),
    (".hidden", "not a run name"), ("a\x1b[31mb", "not a run name"), ("", "not a run name"),
    ("-rf", "not a run name"),
])
def test_unknown_ambiguous_and_hostile_names(root, ref, fragment):
    with pytest.raises(RunDirError) as raised:
        find_run(ref, root)
    line = raised.value.one_line()
    assert fragment in line and "\n" not in line and "\x1b" not in line


def test_paths_are_paths(root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # an existing folder is used as it is (RunInfo.load judges it); '..' and separators never become name lookups
    assert find_run("..", root) == Path("..")
    assert find_run("runs/demo", root) == Path("runs/demo")
    assert find_run("../../etc/passwd", root) == Path("../../etc/passwd")
    assert find_run("nope/nothing", root) == Path("nope/nothing")


def test_runs_outside_the_root_through_symlinks_are_not_candidates(root, tmp_path):
    outside = make_run(tmp_path / "elsewhere", "x", "secret-20991231-000000")
    (root / "linked-exp").symlink_to(outside.parent)
    (root / "demo" / "linked-run-20991231-000000").symlink_to(outside)
    assert "secret-20991231-000000" not in [p.name for p in run_folders(root)]
    assert find_run("latest", root).name == "demo-metaworld-20261125-180000"
    with pytest.raises(RunDirError, match="no run of that name"):
        find_run("secret", root)
    with pytest.raises(RunDirError, match="no run of that name"):
        find_run("linked-run", root)


def test_latest_of_an_empty_or_missing_root(tmp_path):
    for root in (tmp_path / "missing", tmp_path):
        with pytest.raises(RunDirError, match="no run under"):
            find_run("latest", root)


def test_latest_is_never_someone_elses_run(root, monkeypatch):
    """On a shared runs root `latest` is your newest run: runs of other users (readable ones too) are passed over.
    Here every run belongs to someone else: this process claims another uid (the files stay as they are)."""
    from embodyhpc import runstate

    monkeypatch.setattr(runstate.os, "geteuid", lambda: os.stat(root).st_uid + 1)
    with pytest.raises(RunDirError, match=r"no run of yours under .* \(3 of other users\)"):
        find_run("latest", root)
    assert find_run("smoke", root).name == "smoke-20261124-090000"  # a name still finds anyone's run


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
def test_commands_take_a_name_or_latest(cli, root, command):
    for ref in ("latest", "demo-metaworld-20261125-180000", "demo/demo-metaworld-20261125-180000"):
        result = cli(command, ref, "--runs-root", str(root))
        assert result.code == 0, result.err
    bad = cli(command, "demo-metaworld", "--runs-root", str(root))
    one_line_error(bad, "2 runs under", "demo/demo-metaworld-20261125-180000")
    one_line_error(cli(command, "nothing-like-it", "--runs-root", str(root)), "no run of that name")


def test_status_of_latest_reads_the_run(cli, root):
    data = json.loads(cli("status", "latest", "--runs-root", str(root), "--json").out)
    assert data["run_dir"].endswith("demo-metaworld-20261125-180000")


def test_a_damaged_latest_run_is_one_line(cli, root):
    newest = make_run(root, "demo", "demo-metaworld-20261201-000000")
    (newest / "run.json").write_text('{"run_id": "x", "jobs": {')  # half-written
    one_line_error(cli("status", "latest", "--runs-root", str(root)), "damaged run.json")


def test_the_runs_root_comes_from_the_site_profile(cli, root, tmp_path, monkeypatch):
    site = tmp_path / "site.yaml"
    site.write_text(f"site:\n  name: mine\njob:\n  runs_root: {root}\n")
    assert cli("status", "latest", "--site", str(site)).code == 0
    monkeypatch.setenv("EMBODYHPC_SITE", str(site))
    assert cli("status", "smoke").code == 0
    site.write_text("site:\n  name: mine\njob:\n  runs_root: /tmp/%j\n")
    one_line_error(cli("status", "latest"), "job.runs_root", "%")
    monkeypatch.delenv("EMBODYHPC_SITE")
    monkeypatch.chdir(root.parent)  # the default: ./runs
    assert cli("status", "latest").code == 0


def test_eval_ckpt_takes_a_run_name(cli, root):
    one_line_error(cli("eval", "--ckpt", "nothing-like-it", "--runs-root", str(root), "--local"), "no run of that name")
    # latest resolves to the run folder; that run has no export or checkpoint: evaluate says so, on one line
    result = cli("eval", "--ckpt", "latest", "--runs-root", str(root), "--local")
    line = one_line_error(result)
    assert "demo-metaworld-20261125-180000" in line
