"""`data synth --out` into an existing folder: one line and exit 2 without --overwrite; --overwrite replaces only a
dataset this writer wrote, and only once the new one is complete. Every refused folder is left byte for byte."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from embodyhpc.data import DatasetError
from embodyhpc.data.writer import LeRobotWriter, not_replaceable
from tests.data.test_writer import FEATURES, FPS, make_episodes, write


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() or p.is_symlink() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def _ours(root: Path) -> Path:
    write(root, make_episodes(1, 4))
    return root


def _info(root: Path, content: str) -> Path:
    (root / "meta").mkdir(parents=True)
    (root / "meta" / "info.json").write_text(content)
    return root


def _home(tmp_path, monkeypatch) -> Path:
    home = _ours(tmp_path / "home")  # even a home that looks like a dataset of ours
    monkeypatch.setenv("HOME", str(home))
    return home


def _cwd(tmp_path, monkeypatch) -> Path:
    root = _ours(tmp_path / "here")
    monkeypatch.chdir(root / "meta")
    return root


def _cwd_itself(tmp_path, monkeypatch) -> Path:
    root = _ours(tmp_path / "here")
    monkeypatch.chdir(root)
    return root


def _extra_file(tmp_path, monkeypatch) -> Path:
    root = _ours(tmp_path / "ds")
    (root / "notes.txt").write_text("my thesis")
    return root


def _user_file(tmp_path, monkeypatch) -> Path:
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "a.txt").write_text("x")
    return tmp_path / "ds"


def _dot_git(tmp_path, monkeypatch) -> Path:
    root = _ours(tmp_path / "ds")
    (root / ".git").mkdir()
    return root


HOSTILE = {
    "home folder": _home,
    "holds the current folder": _cwd,
    "is the current folder": _cwd_itself,
    "dataset plus a file of the user": _extra_file,
    "dataset under git": _dot_git,
    "no meta/info.json": lambda t, m: (t / "ds" / "data").mkdir(parents=True) or t / "ds",
    "only a file of the user": _user_file,
    "info.json without a version": lambda t, m: _info(t / "ds", "{}"),
    "garbage info.json": lambda t, m: _info(t / "ds", "not json {"),
    "info.json a list": lambda t, m: _info(t / "ds", "[1]"),
    "info.json of another version": lambda t, m: _info(t / "ds", json.dumps({"codebase_version": "v2.1"})),
    "info.json a folder": lambda t, m: (t / "ds" / "meta" / "info.json").mkdir(parents=True) or t / "ds",
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_overwrite_refuses_what_is_not_a_dataset_of_ours(tmp_path, monkeypatch, case):
    root = HOSTILE[case](tmp_path, monkeypatch)
    before = _tree(root)
    with pytest.raises(DatasetError) as caught:
        LeRobotWriter(root, fps=FPS, features=FEATURES, overwrite=True)
    assert "--overwrite refused" in caught.value.one_line() and str(root) in caught.value.one_line()
    assert _tree(root) == before
    assert not list(root.parent.glob(f".{root.name}.*"))


def test_a_file_or_a_link_is_never_replaced(tmp_path):
    dataset = _ours(tmp_path / "ds")
    (tmp_path / "link").symlink_to(dataset)
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "link", tmp_path / "file"):
        with pytest.raises(DatasetError, match="not a folder"):
            LeRobotWriter(path, fps=FPS, features=FEATURES, overwrite=True)
    assert (tmp_path / "file").read_text() == "x" and (dataset / "meta" / "info.json").is_file()


def test_a_folder_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DatasetError, match="cannot create the dataset folder"):
        LeRobotWriter(tmp_path / "file" / "ds", fps=FPS, features=FEATURES)


def test_the_filesystem_root_is_never_replaceable():
    assert "filesystem root" in not_replaceable(Path("/"))


def test_without_overwrite_a_non_empty_folder_is_refused_and_kept(tmp_path):
    root = _ours(tmp_path / "ds")
    before = _tree(root)
    with pytest.raises(DatasetError, match="pass --overwrite"):
        LeRobotWriter(root, fps=FPS, features=FEATURES)
    assert _tree(root) == before


def test_overwrite_replaces_a_dataset_of_ours_only_once_the_new_one_is_complete(tmp_path):
    root = _ours(tmp_path / "ds")
    before = _tree(root)
    with pytest.raises(RuntimeError, match="simulator crashed"), \
            LeRobotWriter(root, fps=FPS, features=FEATURES, overwrite=True) as writer:
        writer.add_episode(make_episodes(1, 4)[0], task="x")
        assert _tree(root) == before  # still the old one while the new one is written
        raise RuntimeError("simulator crashed")
    assert _tree(root) == before and sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    write(root, make_episodes(2, 4), overwrite=True)
    assert json.loads((root / "meta" / "info.json").read_text())["total_episodes"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"] and not (root / ".embodyhpc-writing").exists()


def test_an_unfinished_dataset_of_ours_can_be_overwritten(tmp_path):
    root = tmp_path / "ds"
    with pytest.raises(RuntimeError), LeRobotWriter(root, fps=FPS, features=FEATURES) as writer:
        writer.add_episode(make_episodes(1, 4)[0], task="x")
        raise RuntimeError("killed")
    assert not (root / "meta" / "info.json").exists()
    write(root, make_episodes(1, 4), overwrite=True)
    assert (root / "meta" / "info.json").is_file()


def test_data_synth_cli_into_an_existing_folder(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("MUJOCO_GL", os.environ.get("MUJOCO_GL", "egl"))
    out = tmp_path / "demos"
    args = ("data", "synth", "--out", str(out), "--tasks", "reach-v3", "--episodes", "1", "--cameras", "",
            "--workers", "1")
    assert cli(*args).code == 0
    first = _tree(out)
    refused = cli(*args)
    assert refused.code == 2 and len(refused.err.strip().splitlines()) == 1 and "Traceback" not in refused.err
    assert "--overwrite" in refused.err and str(out) in refused.err and _tree(out) == first
    home = _home(tmp_path, monkeypatch)
    kept = _tree(home)
    result = cli("data", "synth", "--out", str(home), "--tasks", "reach-v3", "--episodes", "1", "--overwrite")
    assert result.code == 2 and "--overwrite refused" in result.err and _tree(home) == kept
    replaced = cli(*args, "--overwrite", "--seed", "1")
    assert replaced.code == 0, replaced.err
    assert json.loads((out / "meta" / "info.json").read_text())["total_episodes"] == 1 and _tree(out) != first
