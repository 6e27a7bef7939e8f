"""Staging against hostile sources, with real folders: links into the destination, loops, links out of the
dataset, special files. Each is refused with one line before anything is copied, and a refused or failed stage
leaves the destination as it found it (no empty folder holding a lock file)."""

from __future__ import annotations

import importlib
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from embodyhpc.staging import MANIFEST_NAME, NotEnoughSpaceError, StageInputError, load_manifest, stage
from embodyhpc.staging.lock import LOCK_NAME
from tests.staging.test_staging import DiskUsage, assert_mirrors, read_tree, write_tree

stage_module = importlib.import_module("embodyhpc.staging.stage")  # the package exports stage()

FILES = {"meta/info.json": b'{"codebase_version": "v3.0"}', "data/chunk-000/file-000.parquet": os.urandom(3000),
         "videos/cam/file-000.mp4": os.urandom(5000)}


@pytest.fixture
def src(tmp_path) -> Path:
    write_tree(tmp_path / "src", FILES)
    return tmp_path / "src"


@pytest.fixture
def dest(tmp_path) -> Path:
    return tmp_path / "nvme" / "dataset"


def link(path: Path, target: str | Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)


def fifo(path: Path) -> None:
    os.mkfifo(path)


def unix_socket(path: Path) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()  # the socket file stays


# (name, how to plant it in the source given (src, dest, tmp_path), what the one-line error says)
HOSTILE = [
    ("link-to-dest", lambda s, d, t: link(s / "link", d), "symlink to the staging destination"),
    ("relative-link-to-dest", lambda s, d, t: link(s / "data/up", "../../nvme/dataset"),
     "symlink to the staging destination"),
    ("link-to-dest-parent", lambda s, d, t: link(s / "nvme", d.parent), "symlink to the staging destination"),
    ("link-to-common-ancestor", lambda s, d, t: link(s / "all", t), "symlink to the staging destination"),
    ("link-to-filesystem-root", lambda s, d, t: link(s / "root", "/"), "symlink to the staging destination"),
    ("link-to-dest-subfolder", lambda s, d, t: link(s / "sub", d / "data"), "symlink to the staging destination"),
    ("link-to-dest-lock-file", lambda s, d, t: link(s / "meta/lock", d / LOCK_NAME),
     "symlink to the staging destination"),
    ("link-to-dest-manifest", lambda s, d, t: link(s / "m.json", d / MANIFEST_NAME),
     "symlink to the staging destination"),
    ("chain-of-links-to-dest", lambda s, d, t: (link(s / "a", s / "b"), link(s / "b", d)),
     "symlink to the staging destination"),
    ("self-loop", lambda s, d, t: link(s / "data/self", "self"), "symlink loop"),
    ("two-link-loop", lambda s, d, t: (link(s / "x", s / "y"), link(s / "y", s / "x")), "symlink loop"),
    ("link-to-own-ancestor", lambda s, d, t: link(s / "data/chunk-000/back", s), "symlink loop"),
    ("broken-link", lambda s, d, t: link(s / "gone", t / "missing"), "broken symlink"),
    ("folder-link-outside", lambda s, d, t: (write_tree(t / "home", {"id_rsa": b"secret"}), link(s / "h", t / "home")),
     "outside the dataset"),
    ("link-to-dev-zero", lambda s, d, t: link(s / "zero.bin", "/dev/zero"), "kernel pseudo-file /dev/zero"),
    ("link-to-dev-null", lambda s, d, t: link(s / "null.bin", "/dev/null"), "kernel pseudo-file /dev/null"),
    ("link-to-proc", lambda s, d, t: link(s / "status", "/proc/self/status"), "kernel pseudo-file /proc/"),
    ("link-to-sys", lambda s, d, t: link(s / "kernel", "/sys/kernel"), "kernel pseudo-file /sys/kernel"),
    ("link-to-outside-fifo", lambda s, d, t: (fifo(t / "pipe"), link(s / "p", t / "pipe")), "symlink to a fifo"),
    ("fifo-in-dataset", lambda s, d, t: fifo(s / "data/pipe"), "a fifo in the dataset"),
    ("socket-in-dataset", lambda s, d, t: unix_socket(s / "meta/sock"), "a socket in the dataset"),
]


def plant(case: str, src: Path, dest: Path, tmp_path: Path) -> tuple[str, str]:
    name, make, expected = next(c for c in HOSTILE if c[0] == case)
    make(src, dest, tmp_path)
    return name, expected


def refused(src: Path, dest: Path, expected: str) -> StageInputError:
    with pytest.raises(StageInputError, match=expected) as caught:
        stage(src, dest, progress=False)
    error = caught.value
    assert error.exit_code == 2 and "\n" not in error.one_line() and "fix:" in error.one_line()
    assert str(src) in error.one_line()  # names the offending entry
    return error


@pytest.mark.parametrize("case", [c[0] for c in HOSTILE])
def test_hostile_source_into_a_new_folder_is_refused_and_leaves_nothing(src, dest, tmp_path, case):
    _, expected = plant(case, src, dest, tmp_path)
    refused(src, dest, expected)
    assert not dest.exists() and not dest.parent.exists()  # neither the folder nor the parent this run made


@pytest.mark.parametrize("case", [c[0] for c in HOSTILE])
def test_hostile_source_into_an_empty_folder_leaves_it_empty(src, dest, tmp_path, case):
    dest.mkdir(parents=True)
    _, expected = plant(case, src, dest, tmp_path)
    refused(src, dest, expected)
    assert dest.is_dir() and list(dest.iterdir()) == []  # no lock file left in it


@pytest.mark.parametrize("case", [c[0] for c in HOSTILE])
def test_hostile_source_over_a_staged_copy_changes_nothing(src, dest, tmp_path, case):
    """A link planted after a good stage: the restage refuses, and the staged copy and its manifest stay whole
    (no nested link/link/... folders, no copied lock file)."""
    stage(src, dest, progress=False)
    before = read_tree(dest)
    _, expected = plant(case, src, dest, tmp_path)
    refused(src, dest, expected)
    assert read_tree(dest) == before and load_manifest(dest).complete
    assert sorted(p.name for p in dest.iterdir()) == sorted([LOCK_NAME, MANIFEST_NAME, "data", "meta", "videos"])


def test_links_staging_follows_are_staged_as_content(src, dest, tmp_path):
    """Allowed: a folder link inside the dataset (copied as a folder) and file links anywhere (a hub cache's
    snapshot -> blob layout); a link to a link to a file too."""
    write_tree(tmp_path / "blobs", {"abc": b"blob"})
    link(src / "alias", src / "data")
    link(src / "meta/stats.json", tmp_path / "blobs/abc")
    link(src / "meta/again.json", src / "meta/stats.json")
    stage(src, dest, progress=False)
    staged = read_tree(dest)
    assert staged["alias/chunk-000/file-000.parquet"] == FILES["data/chunk-000/file-000.parquet"]
    assert staged["meta/stats.json"] == staged["meta/again.json"] == b"blob"
    assert not any(p.is_symlink() for p in dest.rglob("*"))
    assert stage(src, dest, progress=False).num_files_copied == 0  # a restage finds nothing changed


def test_cli_refuses_a_link_to_the_destination_in_one_line(cli, src, dest):
    dest.mkdir(parents=True)
    link(src / "link", dest)
    result = cli("stage", str(src), str(dest), "--quiet")
    assert result.code == 2
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and "symlink to the staging destination" in lines[0] and str(src / "link") in lines[0]
    assert "Traceback" not in result.err and list(dest.iterdir()) == []


def test_a_stage_refused_for_space_leaves_no_folder(src, dest, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(100, 100, 0))
    with pytest.raises(NotEnoughSpaceError):
        stage(src, dest, progress=False)
    assert not dest.exists() and not dest.parent.exists()


def test_a_stage_that_fails_mid_copy_keeps_its_resumable_folder(src, dest, monkeypatch):
    """Once the manifest exists the folder is a staged copy in progress: a failure keeps it, the next run
    resumes."""
    from embodyhpc.staging import transfer

    def fail(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(transfer, "copy_batch", fail)
    with pytest.raises(Exception):  # noqa: B017  the copy error, whatever its class
        stage(src, dest, progress=False)
    assert (dest / MANIFEST_NAME).exists() and not load_manifest(dest).complete
    monkeypatch.undo()
    stage(src, dest, progress=False)
    assert_mirrors(src, dest)


def test_a_run_waiting_on_a_failed_first_run_starts_over(src, dest, tmp_path, monkeypatch):
    """Two runs into one new folder: the first (a refused source, slowed down) removes the folder it made while
    the second waits on its lock; the second notices, makes the folder again and stages."""
    bad = tmp_path / "bad"
    write_tree(bad, {"a": b"x"})
    fifo(bad / "pipe")
    real_scan = stage_module.scan_source
    first_holds_lock = threading.Event()

    def slow_scan(path, *args, **kwargs):
        if Path(path) == bad:
            first_holds_lock.set()
            time.sleep(0.5)
        return real_scan(path, *args, **kwargs)

    monkeypatch.setattr(stage_module, "scan_source", slow_scan)
    errors: list[BaseException] = []

    def first() -> None:
        try:
            stage(bad, dest, progress=False)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    assert first_holds_lock.wait(10)
    stage(src, dest, progress=False)
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], StageInputError) and "fifo" in str(errors[0])
    assert_mirrors(src, dest)
    assert load_manifest(dest).complete
