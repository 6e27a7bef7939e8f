"""Staging to node-local storage: copies, restages, resumes, verifies, guards space, one copier per node."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import pytest

from embodyhpc.staging import (
    MANIFEST_NAME,
    NodeStagingError,
    NotEnoughSpaceError,
    StagedDataError,
    StageInputError,
    StagingError,
    file_hash,
    job_id_from_env,
    load_manifest,
    node_local_path,
    stage,
    stage_on_node,
    transfer,
    verify_staged,
)
from embodyhpc.staging import manifest as manifest_module
from embodyhpc.staging import node as node_module
from embodyhpc.staging.manifest import CONTROL_PREFIX, PARTIAL_SUFFIX
from embodyhpc.staging.progress import Progress

CHUNK = 64 * 1024  # hash leaf in these tests, so a 300 KiB file takes the parallel large-file path
LARGE = "videos/cam0/file-000.mp4"
DiskUsage = namedtuple("DiskUsage", "total used free")  # what shutil.disk_usage returns


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(manifest_module, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(transfer, "BLOCK_BYTES", 16 * 1024)


def write_tree(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def read_tree(root: Path) -> dict[str, bytes]:
    """Every regular file under root except staging's own, by relative path."""
    out = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not rel.startswith(CONTROL_PREFIX):
            out[rel] = path.read_bytes()
    return out


def dataset_files() -> dict[str, bytes]:
    files = {
        "meta/info.json": b'{"codebase_version": "v3.0"}',
        "meta/tasks.parquet": b"",  # empty files are files too
        LARGE: os.urandom(5 * CHUNK + 123),  # 6 leaves, the last one short
        "videos/cam0/exact.mp4": os.urandom(2 * CHUNK),  # a multiple of the leaf size
    }
    files.update({f"data/chunk-000/file-{i:03d}.parquet": os.urandom(100 + 37 * i) for i in range(12)})
    return files


@pytest.fixture
def src(tmp_path) -> Path:
    root = tmp_path / "src"
    write_tree(root, dataset_files())
    (root / "empty_dir").mkdir()
    return root


@pytest.fixture
def dest(tmp_path) -> Path:
    return tmp_path / "nvme" / "dataset"


def assert_mirrors(src: Path, dest: Path) -> None:
    assert read_tree(dest) == read_tree(src)
    assert not list(dest.rglob(f"*{PARTIAL_SUFFIX}"))


def flip_byte(path: Path, offset: int) -> None:
    """Corrupt one byte the way bit rot does: size and mtime unchanged, so only hashing can tell."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# --- copying and restaging -------------------------------------------------------------------------------


def test_fresh_stage_copies_everything_byte_identical(src, dest):
    result = stage(src, dest, workers=4, progress=False)

    files = read_tree(src)
    assert_mirrors(src, dest)
    assert (dest / "empty_dir").is_dir()
    assert (result.num_files_copied, result.num_files_skipped, result.num_files_removed) == (len(files), 0, 0)
    assert result.num_bytes_copied == sum(len(data) for data in files.values())
    assert result.verified and result.num_files_repaired == 0
    manifest = load_manifest(dest)
    assert manifest.complete and manifest.verified and manifest.source == str(src)
    assert sorted(manifest.files) == sorted(files)
    for rel, entry in manifest.files.items():
        assert entry.size == len(files[rel])
        assert entry.mtime_ns == (src / rel).stat().st_mtime_ns == (dest / rel).stat().st_mtime_ns
        assert entry.hash == file_hash(dest / rel, CHUNK)  # the parallel hash equals the sequential one
    assert verify_staged(dest).num_files == len(files)


def test_restage_of_unchanged_data_copies_nothing(src, dest):
    stage(src, dest, progress=False)
    inodes = {rel: (dest / rel).stat().st_ino for rel in read_tree(src)}
    manifest_before = (dest / MANIFEST_NAME).read_bytes()

    result = stage(src, dest, progress=False)

    assert (result.num_files_copied, result.num_bytes_copied, result.num_files_removed) == (0, 0, 0)
    assert result.num_files_skipped == len(inodes)
    assert {rel: (dest / rel).stat().st_ino for rel in inodes} == inodes  # no file was rewritten
    assert (dest / MANIFEST_NAME).read_bytes() == manifest_before


def test_restage_copies_modified_and_added_files_and_deletes_removed_ones(src, dest):
    stage(src, dest, progress=False)
    modified = src / "data/chunk-000/file-003.parquet"
    modified.write_bytes(os.urandom(modified.stat().st_size))  # same size, new content and mtime
    write_tree(src, {"data/chunk-001/file-000.parquet": b"new", LARGE: os.urandom(3 * CHUNK + 1)})
    (src / "meta/tasks.parquet").unlink()
    shutil.rmtree(src / "empty_dir")
    (src / "videos/cam0/exact.mp4").unlink()
    (src / "videos/cam0/exact.mp4").mkdir()  # a file that became a folder

    result = stage(src, dest, progress=False)

    assert_mirrors(src, dest)
    assert not (dest / "empty_dir").exists() and (dest / "videos/cam0/exact.mp4").is_dir()
    assert (result.num_files_copied, result.num_files_removed) == (3, 2)
    assert result.num_files_skipped == len(read_tree(src)) - 3
    assert sorted(load_manifest(dest).files) == sorted(read_tree(src))
    verify_staged(dest)


def test_another_dataset_into_the_same_folder_replaces_the_copy(src, dest, tmp_path):
    stage(src, dest, progress=False)
    other = tmp_path / "other"
    write_tree(other, {"meta/info.json": b"{}", "data/x.parquet": b"x"})

    result = stage(other, dest, progress=False)

    assert_mirrors(other, dest)
    assert result.num_files_copied == 2  # entries made from another source are never trusted
    with pytest.raises(StagedDataError, match="holds a copy of"):
        verify_staged(dest, src=src)
    verify_staged(dest, src=other)


def test_symlinked_files_are_staged_as_their_content(src, dest, tmp_path):
    blob = tmp_path / "blobs" / "abc"
    write_tree(blob.parent, {"abc": b"blob content"})
    (src / "meta/linked.json").symlink_to(blob)

    stage(src, dest, progress=False)

    staged = dest / "meta/linked.json"
    assert not staged.is_symlink() and staged.read_bytes() == b"blob content"


# --- interruption and resume -----------------------------------------------------------------------------


def test_copy_interrupted_midway_resumes_without_recopying_finished_files(src, dest, monkeypatch):
    real_copy_file = transfer.copy_file
    calls = []
    lock = threading.Lock()

    def dies_after_five(*args):  # copy threads call it at once: counted under a lock, the sixth and later die
        with lock:
            if len(calls) >= 5:
                raise RuntimeError("simulated kill")
            calls.append(args)
        return real_copy_file(*args)

    monkeypatch.setattr(transfer, "copy_file", dies_after_five)
    with pytest.raises(RuntimeError, match="simulated kill"):
        stage(src, dest, workers=2, progress=False)

    manifest = load_manifest(dest)
    assert not manifest.complete
    assert len(manifest.files) >= 5  # the finished small files were recorded before the run stopped
    for rel, entry in manifest.files.items():  # and each recorded file is complete
        assert file_hash(dest / rel, CHUNK) == entry.hash
    with pytest.raises(StagedDataError, match="staging did not finish"):
        verify_staged(dest)

    monkeypatch.setattr(transfer, "copy_file", real_copy_file)
    result = stage(src, dest, progress=False)

    assert result.num_files_skipped == len(manifest.files)
    assert result.num_files_copied == len(read_tree(src)) - len(manifest.files)
    assert_mirrors(src, dest)
    verify_staged(dest)


def test_large_file_interrupted_between_chunks_is_never_taken_as_complete(src, dest, monkeypatch):
    real_copy_chunk = transfer.copy_chunk

    def fails_on_chunk_3(src_root, dest_root, task):
        if task.file.rel == LARGE and task.index == 3:
            raise StagingError("simulated I/O error")
        return real_copy_chunk(src_root, dest_root, task)

    monkeypatch.setattr(transfer, "copy_chunk", fails_on_chunk_3)
    with pytest.raises(StagingError, match="simulated I/O error"):
        stage(src, dest, workers=3, progress=False)

    assert not (dest / LARGE).exists()  # the chunks that landed sit in the partial file only
    assert (dest / (LARGE + PARTIAL_SUFFIX)).exists()
    assert LARGE not in load_manifest(dest).files

    monkeypatch.setattr(transfer, "copy_chunk", real_copy_chunk)
    result = stage(src, dest, progress=False)

    assert result.num_files_removed == 0  # leftover partial files are cleaned up, not counted
    assert_mirrors(src, dest)


def test_killed_run_state_resumes(src, dest):
    """What a SIGKILL leaves: a manifest missing the file in flight, its partial copy, an old unlisted file."""
    stage(src, dest, progress=False)
    rel = "data/chunk-000/file-007.parquet"
    path = dest / "data/chunk-000/file-007.parquet"
    data = json.loads((dest / MANIFEST_NAME).read_text())
    del data["files"][rel]
    data["complete"] = False
    (dest / MANIFEST_NAME).write_text(json.dumps(data))
    Path(str(path) + PARTIAL_SUFFIX).write_bytes(path.read_bytes()[:10])
    path.write_bytes(path.read_bytes()[:-1])

    with pytest.raises(StagedDataError, match="did not finish"):
        verify_staged(dest)
    result = stage(src, dest, progress=False)

    assert (result.num_files_copied, result.num_files_removed) == (1, 0)
    assert_mirrors(src, dest)
    verify_staged(dest)


# --- verification ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rel, offset", [("data/chunk-000/file-005.parquet", 17), (LARGE, 3 * CHUNK + 5)])
def test_flipped_byte_is_detected_and_repaired(src, dest, rel, offset):
    stage(src, dest, progress=False)
    flip_byte(dest / rel, offset)

    with pytest.raises(StagedDataError) as caught:
        verify_staged(dest)
    assert caught.value.problems == [(rel, "content differs (hash mismatch)")]
    message = caught.value.one_line()
    assert rel in message and str(dest) in message and "\n" not in message and "embodyhpc stage" in message

    result = stage(src, dest, progress=False)

    assert (result.num_files_repaired, result.num_files_copied) == (1, 1)
    assert result.num_files_skipped == len(read_tree(src)) - 1
    assert_mirrors(src, dest)
    verify_staged(dest)


def test_without_verify_restaging_trusts_size_and_mtime(src, dest):
    stage(src, dest, progress=False)
    flip_byte(dest / LARGE, 0)

    assert stage(src, dest, verify=False, progress=False).num_files_copied == 0  # the documented trade-off
    with pytest.raises(StagedDataError, match="hash mismatch"):
        verify_staged(dest)


def test_truncated_and_missing_files_are_detected_and_recopied(src, dest):
    stage(src, dest, progress=False)
    truncated = dest / LARGE
    truncated.write_bytes(truncated.read_bytes()[: 2 * CHUNK])
    (dest / "meta/info.json").unlink()

    with pytest.raises(StagedDataError) as caught:
        verify_staged(dest)
    assert dict(caught.value.problems) == {LARGE: f"{2 * CHUNK} bytes, expected {5 * CHUNK + 123}",
                                           "meta/info.json": "missing"}

    result = stage(src, dest, progress=False)
    assert result.num_files_copied == 2 and result.num_files_repaired == 0  # size alone gave them away
    assert_mirrors(src, dest)


def test_verify_staged_refuses_what_was_never_staged(tmp_path):
    with pytest.raises(StagedDataError, match="does not exist"):
        verify_staged(tmp_path / "nowhere")
    (tmp_path / "plain").mkdir()
    with pytest.raises(StagedDataError, match="no staging manifest"):
        verify_staged(tmp_path / "plain")


# --- free space and bad arguments ------------------------------------------------------------------------


def test_not_enough_space_fails_before_anything_is_copied(src, dest, monkeypatch):
    free = 10 * 1024 * 1024
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10 * free, 9 * free, free))

    with pytest.raises(NotEnoughSpaceError) as caught:
        stage(src, dest, progress=False)

    message = caught.value.one_line()
    assert str(dest) in message and "needed" in message and "10.0 MiB available" in message
    assert "staging.nvme_dir" in message and "\n" not in message
    assert read_tree(dest) == {} and not (dest / MANIFEST_NAME).exists()


def test_low_space_does_not_block_a_restage_with_nothing_to_copy(src, dest, monkeypatch):
    stage(src, dest, progress=False)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(100, 100, 0))
    assert stage(src, dest, progress=False).num_files_copied == 0


def test_bad_arguments_are_one_line_user_errors(src, dest, tmp_path):
    foreign = tmp_path / "home"
    write_tree(foreign, {"thesis.tex": b"do not delete"})
    (tmp_path / "file").write_bytes(b"")
    (src / "broken").symlink_to(tmp_path / "missing-target")
    cases = [
        (tmp_path / "missing", dest, "does not exist"),
        (tmp_path / "file", dest, "this is a file"),
        (src, src / "staged", "overlap"),
        (tmp_path / "other", foreign, "not empty"),
        (src, dest, "broken symlink"),
    ]
    (tmp_path / "other").mkdir()
    for source, destination, expected in cases:
        with pytest.raises(StageInputError, match=expected) as caught:
            stage(source, destination, progress=False)
        assert caught.value.exit_code == 2 and "fix:" in caught.value.one_line()
    assert (foreign / "thesis.tex").read_bytes() == b"do not delete"


def test_symlink_loop_is_refused(src, dest):
    (src / "data/loop").symlink_to(src)
    with pytest.raises(StageInputError, match="symlink loop"):
        stage(src, dest, progress=False)


# --- one copier per node ---------------------------------------------------------------------------------


def count_copies(monkeypatch) -> list[str]:
    """Record every file copy (small and large) into the returned list."""
    copied: list[str] = []
    real_copy_file, real_start_large = transfer.copy_file, transfer.start_large_copy

    def copy_file(src_root, dest_root, f):
        copied.append(f.rel)
        return real_copy_file(src_root, dest_root, f)

    def start_large_copy(dest_root, f):
        copied.append(f.rel)
        return real_start_large(dest_root, f)

    monkeypatch.setattr(transfer, "copy_file", copy_file)
    monkeypatch.setattr(transfer, "start_large_copy", start_large_copy)
    return copied


def run_local_ranks(src, dest, num_ranks: int, **options) -> list:
    """Local ranks as threads started together; each slot holds the rank's result or exception."""
    outcomes: list = [None] * num_ranks
    barrier = threading.Barrier(num_ranks)

    def rank(local_rank: int) -> None:
        barrier.wait()
        try:
            outcomes[local_rank] = stage_on_node(src, dest, local_rank=local_rank, poll_s=0.01, progress=False,
                                                 **options)
        except Exception as exc:
            outcomes[local_rank] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(num_ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return outcomes


def test_stage_on_node_copies_once_and_the_other_ranks_wait(src, dest, monkeypatch):
    copied = count_copies(monkeypatch)

    results = run_local_ranks(src, dest, 3, job_id="4242.0.0")

    assert sorted(copied) == sorted(read_tree(src))  # every file exactly once
    assert all(r == results[0] for r in results) and results[0].num_files_copied == len(copied)
    assert_mirrors(src, dest)
    markers = dest / node_module.MARKERS_DIR
    assert sorted(p.name for p in markers.iterdir()) == ["4242.0.0.done"]

    copied.clear()  # the next job on this node restages: nothing to copy
    results = run_local_ranks(src, dest, 3, job_id="4243.0.0")
    assert copied == [] and [r.num_files_skipped for r in results] == [len(read_tree(src))] * 3


def _rank_process(src, dest, local_rank, log_path, queue):
    real_stage = node_module.stage

    def logged_stage(*args, **kwargs):
        with open(log_path, "a") as log:
            log.write(f"{local_rank}\n")
        return real_stage(*args, **kwargs)

    node_module.stage = logged_stage
    try:
        result = stage_on_node(src, dest, local_rank=local_rank, job_id="77.0.0", poll_s=0.01, progress=False)
        queue.put((local_rank, result.num_files_copied))
    except Exception as exc:
        queue.put((local_rank, repr(exc)))


def test_stage_on_node_across_processes(src, dest, tmp_path):
    context = multiprocessing.get_context("fork")  # ranks are processes in a real job
    queue = context.Queue()
    log = tmp_path / "stagers.log"
    procs = [context.Process(target=_rank_process, args=(src, dest, r, log, queue)) for r in (2, 1, 0)]
    for p in procs:
        p.start()
    outcomes = dict(queue.get(timeout=30) for _ in procs)
    for p in procs:
        p.join(timeout=30)

    assert log.read_text() == "0\n"  # one copier
    assert outcomes == {r: len(read_tree(src)) for r in (0, 1, 2)}
    assert_mirrors(src, dest)


def test_copier_failure_reaches_the_waiting_ranks(src, dest, monkeypatch):
    def broken_copy(*args):
        raise StagingError("input/output error", where="/lustre/datasets/x")

    monkeypatch.setattr(transfer, "copy_file", broken_copy)
    outcomes = run_local_ranks(src, dest, 3, job_id="99.0.0")  # waiters left on their own would wait 6 hours

    assert isinstance(outcomes[0], StagingError) and not isinstance(outcomes[0], NodeStagingError)
    for waiter in outcomes[1:]:
        assert isinstance(waiter, NodeStagingError)
        message = waiter.one_line()
        assert "local rank 0 failed" in message and "input/output error" in message and "\n" not in message


def test_waiters_give_up_when_no_copier_starts(src, dest):
    started = time.monotonic()
    with pytest.raises(NodeStagingError, match="never started"):
        stage_on_node(src, dest, local_rank=1, job_id="5.0.0", timeout_s=0.2, poll_s=0.02)
    assert time.monotonic() - started >= 0.2  # after the timeout, not before


def test_waiters_notice_a_dead_copier_by_its_stale_heartbeat(src, dest):
    markers = dest / node_module.MARKERS_DIR
    markers.mkdir(parents=True)
    running = markers / "6.0.0.running"
    running.write_text("{}")
    os.utime(running, (time.time() - 600, time.time() - 600))

    with pytest.raises(NodeStagingError, match="no heartbeat"):
        stage_on_node(src, dest, local_rank=2, job_id="6.0.0", stale_s=60, poll_s=0.02, timeout_s=5)


def test_concurrent_stages_into_one_folder_take_turns(src, dest, monkeypatch):
    copied = count_copies(monkeypatch)
    outcomes: list = []

    def job() -> None:
        outcomes.append(stage(src, dest, workers=2, progress=False))

    threads = [threading.Thread(target=job) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)

    assert sorted(copied) == sorted(read_tree(src))  # the second run found everything staged
    assert sorted(r.num_files_copied for r in outcomes) == [0, len(copied)]
    verify_staged(dest)


def test_job_id_comes_from_slurm_or_torchrun():
    assert job_id_from_env({"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "2"}) == "12.0.2"
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun-abc"
    assert job_id_from_env({"TORCHELASTIC_RUN_ID": "none"}) is None


def test_stage_on_node_without_a_job_id_says_how_to_fix_it(src, dest, monkeypatch):
    for name in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(StageInputError, match="pass job_id="):
        stage_on_node(src, dest, local_rank=1)


def test_node_local_path_keeps_same_named_datasets_apart(tmp_path):
    first = node_local_path("/nvme", "/lustre/a/pusht")
    assert first.parent == Path("/nvme") and first.name.startswith("pusht-")
    assert first != node_local_path("/nvme", "/lustre/b/pusht")
    assert first == node_local_path("/nvme", "/lustre/a/pusht/")


# --- progress and dependencies ---------------------------------------------------------------------------


def test_progress_prints_plain_lines_off_a_terminal_and_nothing_when_disabled(src, dest, capsys):
    stage(src, dest, progress=True)
    err = capsys.readouterr().err
    assert "stage copy:" in err and "files" in err and "/s" in err and f"-> {dest}" in err

    stage(src, dest, progress=False)
    assert capsys.readouterr() == ("", "")


def test_progress_draws_a_rich_bar_on_a_terminal():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    with Progress("copy", 2048, 2, enabled=True, stream=stream) as bar:
        bar.advance(1024, 1)
        bar.advance(1024, 1)
    assert "stage copy" in stream.getvalue() and "2/2 files" in stream.getvalue()


def test_staging_modules_never_import_torch():
    """The staging step runs before anything else in a job; it must not pay for (or need) torch."""
    package = Path(__file__).resolve().parents[2] / "embodyhpc" / "data"
    code = ("import sys, types\n"
            "pkg = types.ModuleType('embodyhpc.data')\n"  # skip embodyhpc.data's own __init__ (the readers)
            f"pkg.__path__ = [{str(package)!r}]\n"
            "sys.modules['embodyhpc.data'] = pkg\n"
            "import embodyhpc.staging\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --- restage fast path and verify modes ------------------------------------------------------------------


def forbid_reading_staged_or_source_content(monkeypatch) -> None:
    """Every content read staging does goes through these: make each one fail the test."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a restage of unchanged data read file contents")

    for name in ("copy_file", "copy_chunk", "start_large_copy", "hash_batch", "hash_chunk", "leaf_hasher"):
        monkeypatch.setattr(transfer, name, forbidden)
    monkeypatch.setattr(manifest_module, "file_hash", forbidden)


def count_rehashes(monkeypatch) -> list[str]:
    """Record every staged file (small) or chunk (large) that verification reads."""
    read: list[str] = []
    real_batch, real_chunk = transfer.hash_batch, transfer.hash_chunk

    def hash_batch(dest_root, task, from_device=False):
        read.extend(f.rel for f in task.files)
        return real_batch(dest_root, task, from_device)

    def hash_chunk(dest_root, task, from_device=False):
        read.append(task.file.rel)
        return real_chunk(dest_root, task, from_device)

    monkeypatch.setattr(transfer, "hash_batch", hash_batch)
    monkeypatch.setattr(transfer, "hash_chunk", hash_chunk)
    return read


def test_unchanged_restage_is_a_stat_walk_that_reads_no_content(src, dest, monkeypatch):
    first = stage(src, dest, progress=False)
    assert first.verify == "quick" and first.verified and first.num_files_rehashed == 0  # hashed while copying
    manifest_before = (dest / MANIFEST_NAME).read_bytes()
    forbid_reading_staged_or_source_content(monkeypatch)

    result = stage(src, dest, progress=False)

    assert (result.num_files_copied, result.num_files_rehashed, result.num_files_repaired) == (0, 0, 0)
    assert result.num_files_skipped == len(read_tree(src)) and result.verified
    assert (dest / MANIFEST_NAME).read_bytes() == manifest_before
    assert load_manifest(dest).complete and load_manifest(dest).verified


def test_source_modified_with_same_size_and_new_mtime_is_copied_again(src, dest, monkeypatch):
    stage(src, dest, progress=False)
    rel = "data/chunk-000/file-004.parquet"
    path = src / rel
    before = path.stat()
    path.write_bytes(os.urandom(before.st_size))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    copied = count_copies(monkeypatch)

    result = stage(src, dest, progress=False)

    assert copied == [rel] and result.num_files_copied == 1
    assert (dest / rel).read_bytes() == path.read_bytes()
    verify_staged(dest)


def test_source_replaced_with_same_size_and_mtime_is_copied_again(src, dest, monkeypatch):
    """A new file renamed over the old one (rsync, cp -p): size and mtime equal, the inode tells."""
    stage(src, dest, progress=False)
    rel = "data/chunk-000/file-006.parquet"
    path = src / rel
    before = path.stat()
    replacement = src / "data/replacement.tmp"
    replacement.write_bytes(os.urandom(before.st_size))
    os.utime(replacement, ns=(before.st_atime_ns, before.st_mtime_ns))
    keep_alive = path.open("rb")  # holds the old inode, so the filesystem cannot hand its number out again
    try:
        os.replace(replacement, path)
        assert path.stat().st_ino != before.st_ino and path.stat().st_mtime_ns == before.st_mtime_ns
        copied = count_copies(monkeypatch)
        stage(src, dest, progress=False)
    finally:
        keep_alive.close()

    assert copied == [rel]
    assert (dest / rel).read_bytes() == path.read_bytes()


@pytest.mark.parametrize("rel", ["data/chunk-000/file-002.parquet", LARGE])
def test_staged_file_truncated_after_staging_is_copied_again(src, dest, monkeypatch, rel):
    stage(src, dest, progress=False)
    path = dest / rel
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    copied = count_copies(monkeypatch)

    result = stage(src, dest, progress=False)

    assert copied == [rel] and result.num_files_copied == 1
    assert_mirrors(src, dest)
    verify_staged(dest)


@pytest.mark.parametrize("rel", ["data/chunk-000/file-009.parquet", LARGE])
def test_staged_file_edited_after_staging_with_mtime_restored_is_rehashed_and_repaired(src, dest, monkeypatch,
                                                                                       rel):
    """An edit that keeps size and (restored) mtime still moves ctime: quick re-hashes just that file."""
    stage(src, dest, progress=False)
    flip_byte(dest / rel, 1)
    rehashed = count_rehashes(monkeypatch)

    result = stage(src, dest, progress=False)

    assert (result.num_files_repaired, result.num_files_copied) == (1, 1)
    assert set(rehashed) == {rel}  # only the file whose stat moved was read
    assert_mirrors(src, dest)
    verify_staged(dest)


def test_chmod_of_a_staged_file_costs_a_rehash_not_a_copy(src, dest, monkeypatch):
    stage(src, dest, progress=False)
    rel = "meta/info.json"
    os.chmod(dest / rel, 0o640)
    copied = count_copies(monkeypatch)
    rehashed = count_rehashes(monkeypatch)

    result = stage(src, dest, progress=False)

    assert copied == [] and rehashed == [rel] and result.num_files_rehashed == 1
    rehashed.clear()
    assert stage(src, dest, progress=False).num_files_rehashed == 0 and rehashed == []  # new signature recorded


def simulate_bit_rot(dest: Path, rel: str, offset: int) -> None:
    """Flip a byte so that stat cannot tell: size and mtime restored, and the manifest's ctime moved along
    (the device corrupting data behind the filesystem's back changes no metadata at all)."""
    flip_byte(dest / rel, offset)
    data = json.loads((dest / MANIFEST_NAME).read_text())
    data["files"][rel][6] = (dest / rel).stat().st_ctime_ns  # [size, mtime, hash, dest_mtime, ino, dino, dctime]
    (dest / MANIFEST_NAME).write_text(json.dumps(data))


@pytest.mark.parametrize("rel, offset", [("data/chunk-000/file-011.parquet", 40), (LARGE, 4 * CHUNK + 7)])
def test_full_verification_catches_what_stat_cannot_see(src, dest, rel, offset):
    stage(src, dest, progress=False)
    simulate_bit_rot(dest, rel, offset)

    quick = stage(src, dest, progress=False)
    assert quick.num_files_copied == 0 and quick.num_files_rehashed == 0  # the documented limit of quick
    with pytest.raises(StagedDataError, match="hash mismatch"):
        verify_staged(dest, full=True)
    verify_staged(dest, full=False)  # the stat check alone is fooled too

    full = stage(src, dest, verify="full", progress=False)

    assert (full.num_files_repaired, full.num_files_copied, full.verify) == (1, 1, "full")
    assert full.num_files_rehashed == len(read_tree(src)) + 1  # every file, plus the repaired one again
    assert_mirrors(src, dest)
    verify_staged(dest)


def test_write_interrupted_mid_file_resumes_and_completes(src, dest, monkeypatch):
    """An exception in the middle of writing a file (after some of its bytes landed) stops the run; the next
    run finishes the copy, and nothing half-written is ever listed."""
    real_write_all = transfer._write_all
    writes = []

    def fails_on_write_31(fd, data, offset=None):
        # with one worker: writes 0-28 are the two large files' blocks (largest first), then small files
        if len(writes) == 31:
            os.write(fd, bytes(data[: max(1, len(data) // 2)]))  # a torn write, then the failure
            raise OSError(5, "simulated I/O error")
        writes.append(len(data))
        return real_write_all(fd, data, offset)

    monkeypatch.setattr(transfer, "_write_all", fails_on_write_31)
    with pytest.raises(StagingError, match="simulated I/O error"):
        stage(src, dest, workers=1, progress=False)

    manifest = load_manifest(dest)
    assert not manifest.complete and 0 < len(manifest.files) < len(read_tree(src))
    for rel, entry in manifest.files.items():
        assert file_hash(dest / rel, CHUNK) == entry.hash
    with pytest.raises(StagedDataError, match="did not finish"):
        verify_staged(dest)

    monkeypatch.setattr(transfer, "_write_all", real_write_all)
    result = stage(src, dest, progress=False)

    assert result.num_files_skipped == len(manifest.files)
    assert result.num_files_copied == len(read_tree(src)) - len(manifest.files)
    assert_mirrors(src, dest)
    verify_staged(dest)


def test_unlisted_file_left_at_its_final_name_is_copied_again(src, dest):
    """What a SIGKILL during an in-place write of a new file leaves: a torn file the manifest does not list."""
    stage(src, dest, progress=False)
    rel = "data/chunk-000/file-010.parquet"
    data = json.loads((dest / MANIFEST_NAME).read_text())
    del data["files"][rel]
    data["complete"] = False
    (dest / MANIFEST_NAME).write_text(json.dumps(data))
    (dest / rel).write_bytes(b"torn")
    os.utime(dest / rel, ns=((src / rel).stat().st_atime_ns, (src / rel).stat().st_mtime_ns))

    result = stage(src, dest, progress=False)

    assert result.num_files_copied == 1
    assert_mirrors(src, dest)
    verify_staged(dest)


@pytest.mark.parametrize("version, hash_name", [(2, "blake2b-128-tree"), (1, "blake2b-128-tree")])
def test_manifest_of_an_older_hash_is_copied_again_once(src, dest, monkeypatch, version, hash_name):
    """Its hashes cannot vouch for the staged files under today's hash: everything is copied once, then trusted."""
    stage(src, dest, progress=False)
    data = json.loads((dest / MANIFEST_NAME).read_text())
    data.update(version=version, hash=hash_name)
    (dest / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(StagingError, match="unreadable staging manifest"):
        verify_staged(dest)  # training refuses it until staged again
    copied = count_copies(monkeypatch)

    result = stage(src, dest, progress=False)

    assert sorted(copied) == sorted(read_tree(src)) and result.num_files_copied == len(copied)
    assert_mirrors(src, dest)
    written = json.loads((dest / MANIFEST_NAME).read_text())
    assert (written["version"], written["hash"]) == (manifest_module.MANIFEST_VERSION, manifest_module.HASH_NAME)
    verify_staged(dest)  # every staged file re-read: its hash under today's function matches the manifest
    forbid_reading_staged_or_source_content(monkeypatch)
    assert stage(src, dest, progress=False).num_files_copied == 0


def test_file_hash_is_xxh3_128_over_leaf_digests(tmp_path):
    """The manifest's hash, computed independently: XXH3-128 leaves (seeded) and a root over their digests."""
    import xxhash

    data = os.urandom(2 * CHUNK + 5)
    (tmp_path / "f").write_bytes(data)
    leaves = [xxhash.xxh3_128(data[i:i + CHUNK], seed=manifest_module._LEAF_SEED).digest()
              for i in range(0, len(data), CHUNK)]
    expected = xxhash.xxh3_128(b"".join(leaves), seed=manifest_module._ROOT_SEED).hexdigest()
    assert manifest_module.file_hash(tmp_path / "f", CHUNK) == expected
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    root_of_empty = xxhash.xxh3_128(xxhash.xxh3_128(b"", seed=manifest_module._LEAF_SEED).digest(),
                                    seed=manifest_module._ROOT_SEED).hexdigest()
    assert manifest_module.file_hash(empty, CHUNK) == root_of_empty != expected


def test_verify_modes_and_their_spellings(src, dest):
    assert stage(src, dest, verify=True, progress=False).verify == "quick"
    assert stage(src, dest, verify=False, progress=False).verify == "none"
    assert stage(src, dest, verify="FULL", progress=False).verify == "full"
    with pytest.raises(StageInputError, match="verify must be one of"):
        stage(src, dest, verify="sometimes", progress=False)


def test_staging_config_verify_keeps_old_recipes_valid():
    from embodyhpc.config.schema import StagingConfig
    from embodyhpc.errors import ConfigError

    assert StagingConfig().verify == "quick"
    assert StagingConfig(verify="true").verify == "quick" and StagingConfig(verify="false").verify == "none"
    assert StagingConfig(verify=True).verify == "quick" and StagingConfig(verify="full").verify == "full"
    with pytest.raises(ConfigError, match="staging.verify"):
        StagingConfig(verify="sometimes")


def test_stage_cli_takes_a_verify_mode(src, dest):
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    out = runner.invoke(app, ["stage", str(src), str(dest), "--verify", "full", "-q"])
    assert out.exit_code == 0, out.output
    assert "(full)" in out.output and f"{len(read_tree(src))} re-hashed" in out.output
    out = runner.invoke(app, ["stage", str(src), str(dest), "--no-verify", "-q"])
    assert out.exit_code == 0 and "(none)" in out.output


@pytest.mark.parametrize("fast_stats, fstype, fast", [(True, "ext4", True), (False, "ext4", False),
                                                      (True, "lustre", False), (True, None, False)])
def test_small_files_of_a_fast_source_are_copied_on_one_thread(src, dest, monkeypatch, fast_stats, fstype, fast):
    """A local source answering stats in microseconds: small files on the one 'small' thread, chunks of large files
    on the pool. A slow one, or a network filesystem whose stats come from its client's cache (opens still wait on
    a server), or one of unknown type: everything on the pool."""
    from embodyhpc import mounts
    from embodyhpc.staging import tree
    monkeypatch.setattr(tree, "_INLINE_STAT_S", float("inf") if fast_stats else 0.0)
    monkeypatch.setattr(mounts, "read_mounts", lambda: [mounts.Mount("dev", "/", fstype)] if fstype else [])
    threads: dict[str, set[str]] = {}
    real_copy_file, real_copy_chunk = transfer.copy_file, transfer.copy_chunk

    def copy_file(src_root, dest_root, f):
        threads.setdefault(f.rel, set()).add(threading.current_thread().name.rsplit("_", 1)[0])
        return real_copy_file(src_root, dest_root, f)

    def copy_chunk(src_root, dest_root, task):
        threads.setdefault(task.file.rel, set()).add(threading.current_thread().name.rsplit("_", 1)[0])
        return real_copy_chunk(src_root, dest_root, task)

    monkeypatch.setattr(transfer, "copy_file", copy_file)
    monkeypatch.setattr(transfer, "copy_chunk", copy_chunk)

    stage(src, dest, workers=4, progress=False)

    assert_mirrors(src, dest)
    small = {rel for rel in read_tree(src) if len(read_tree(src)[rel]) <= CHUNK}
    assert small and set(threads) == set(read_tree(src))
    for rel, names in threads.items():
        expected = "embodyhpc-stage-small" if fast and rel in small else "embodyhpc-stage"
        assert names == {expected}, rel
