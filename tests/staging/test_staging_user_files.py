"""Restaging never deletes a file it did not itself stage: what a person (or a job) put into a staged folder that the
source does not have is refused in one line, before anything changes, and left as it was. Files staging put there
and the source no longer has are deleted as before, even when a killed run left them half-way."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

from embodyhpc.staging import MANIFEST_NAME, StageInputError, load_manifest, stage, verify_staged
from tests.staging.test_staging import assert_mirrors, read_tree, write_tree

stage_module = importlib.import_module("embodyhpc.staging.stage")  # the package exports stage()

FILES = {"meta/info.json": b'{"codebase_version": "v3.0"}', "data/chunk-000/file-000.parquet": os.urandom(3000),
         "data/chunk-000/file-001.parquet": os.urandom(2000), "videos/cam/file-000.mp4": os.urandom(5000)}


@pytest.fixture
def staged(tmp_path) -> tuple[Path, Path]:
    src, dest = tmp_path / "src", tmp_path / "nvme" / "dataset"
    write_tree(src, FILES)
    stage(src, dest, progress=False)
    return src, dest


def _snapshot(dest: Path) -> dict[str, bytes]:
    """Every entry under dest: file contents, link targets, folders (the manifest and lock included)."""
    out = {}
    for path in sorted(dest.rglob("*")):
        rel = str(path.relative_to(dest))
        out[rel] = (b"link:" + os.readlink(path).encode() if path.is_symlink()
                    else b"dir" if path.is_dir() else path.read_bytes() if path.is_file() else b"special")
    return out


def _plant_link(dest: Path, tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere.txt"
    target.write_text("the link's target")
    (dest / "data" / "mine.link").symlink_to(target)
    return dest / "data" / "mine.link"


# (case, plant(dest, tmp_path), the name the error shows)
USER_FILES = [
    ("top-level-notes", lambda d, t: (d / "NOTES.md").write_text("my notes"), "NOTES.md"),
    ("file-beside-staged-ones", lambda d, t: (d / "data/chunk-000/results.csv").write_text("1,2"),
     "data/chunk-000/results.csv"),
    ("a-folder-of-outputs", lambda d, t: write_tree(d / "outputs", {"run1/metrics.json": b"{}"}),
     "outputs/run1/metrics.json"),
    ("a-symlink", _plant_link, "data/mine.link"),
    ("a-fifo", lambda d, t: os.mkfifo(d / "meta" / "pipe"), "meta/pipe"),
    ("named-like-a-control-file-inside", lambda d, t: (d / "data" / ".embodyhpc-notes").write_text("x"),
     "data/.embodyhpc-notes"),
]


@pytest.mark.parametrize(("case", "plant", "shown"), USER_FILES, ids=[c[0] for c in USER_FILES])
def test_a_file_put_into_a_staged_folder_is_never_deleted(staged, tmp_path, case, plant, shown):
    src, dest = staged
    plant(dest, tmp_path)
    (src / "data/chunk-000/file-001.parquet").unlink()  # a real change the restage would make
    before = _snapshot(dest)
    with pytest.raises(StageInputError, match="staging did not put there") as caught:
        stage(src, dest, progress=False)
    line = caught.value.one_line()
    assert caught.value.exit_code == 2 and "\n" not in line and shown in line and str(dest) in line
    assert _snapshot(dest) == before  # nothing changed: not the user's file, not the staged ones, not the manifest


def test_moving_the_file_out_lets_the_restage_go_on(staged):
    src, dest = staged
    (dest / "NOTES.md").write_text("my notes")
    with pytest.raises(StageInputError):
        stage(src, dest, progress=False)
    (dest / "NOTES.md").unlink()
    stage(src, dest, progress=False)
    assert_mirrors(src, dest)
    verify_staged(dest)


def test_many_user_files_are_counted_in_one_line(staged):
    src, dest = staged
    write_tree(dest / "mine", {f"f{i}.txt": b"x" for i in range(7)})
    with pytest.raises(StageInputError, match=r"\(7 in all\)"):
        stage(src, dest, progress=False)
    assert len(list((dest / "mine").iterdir())) == 7


def test_the_cli_refuses_in_one_line(cli, staged):
    src, dest = staged
    (dest / "NOTES.md").write_text("my notes")
    result = cli("stage", str(src), str(dest), "--quiet")
    assert result.code == 2 and "Traceback" not in result.err
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "NOTES.md" in lines[0] and "never deletes" in lines[0]
    assert (dest / "NOTES.md").read_text() == "my notes"


def test_a_file_staging_put_there_is_still_deleted_when_the_source_drops_it(staged):
    src, dest = staged
    (src / "videos/cam/file-000.mp4").unlink()
    result = stage(src, dest, progress=False)
    assert result.num_files_removed == 1 and not (dest / "videos/cam/file-000.mp4").exists()
    assert_mirrors(src, dest)


def test_an_empty_folder_holds_nothing_to_lose_and_is_removed(staged):
    src, dest = staged
    (dest / "scratch").mkdir()
    stage(src, dest, progress=False)
    assert not (dest / "scratch").exists()
    assert_mirrors(src, dest)


def test_files_of_another_source_staged_here_are_staging_s_own(staged, tmp_path):
    src, dest = staged
    other = tmp_path / "other"
    write_tree(other, {"meta/info.json": b"{}", "x.parquet": b"x"})
    stage(other, dest, progress=False)
    assert_mirrors(other, dest)


def test_a_run_killed_before_it_deleted_still_knows_what_it_staged(staged, monkeypatch):
    """The first manifest write of a restage (complete=False) happens before the deletions: a run killed in between
    must leave the files to delete listed, or the next run would take them for a user's and refuse."""
    src, dest = staged
    (src / "data/chunk-000/file-001.parquet").unlink()

    def killed(self, plan):
        raise KeyboardInterrupt  # after the manifest was flushed, before anything was deleted

    monkeypatch.setattr(stage_module._StageRun, "_remove", killed)
    with pytest.raises(KeyboardInterrupt):
        stage(src, dest, progress=False)
    assert not load_manifest(dest).complete and (dest / "data/chunk-000/file-001.parquet").exists()
    monkeypatch.undo()

    result = stage(src, dest, progress=False)
    assert result.num_files_removed == 1
    assert_mirrors(src, dest)
    verify_staged(dest)
    assert "data/chunk-000/file-001.parquet" not in load_manifest(dest).files


def test_with_an_unreadable_manifest_only_source_paths_are_rewritten(staged):
    """A damaged manifest no longer says what staging put there: files at the source's paths are copied again,
    anything else is refused rather than guessed at."""
    src, dest = staged
    (dest / MANIFEST_NAME).write_text("{not json")
    (dest / "NOTES.md").write_text("my notes")
    with pytest.raises(StageInputError, match="NOTES.md"):
        stage(src, dest, progress=False)
    assert (dest / "NOTES.md").read_text() == "my notes"
    (dest / "NOTES.md").unlink()
    stage(src, dest, progress=False)
    assert_mirrors(src, dest)
    assert json.loads((dest / MANIFEST_NAME).read_text())["complete"] is True
    assert read_tree(dest) == read_tree(src)
