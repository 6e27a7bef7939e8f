"""Checking a staged copy against its manifest: `verify_staged(dest)` before training reads it."""

from __future__ import annotations

import os
import stat
import sys
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from embodyhpc.staging import transfer
from embodyhpc.staging.errors import StagedDataError
from embodyhpc.staging.lock import dest_lock
from embodyhpc.staging.manifest import MANIFEST_NAME, FileEntry, load_manifest, num_leaves, root_hash
from embodyhpc.staging.progress import Progress
from embodyhpc.staging.transfer import Chunk, Signature, WholeFiles, make_tasks, run_tasks
from embodyhpc.staging.tree import SourceFile

TASKS_PER_WORKER = 4  # in flight per worker: enough to keep every worker busy, little memory
_HASH_MISMATCH = "content differs (hash mismatch)"


@dataclass(frozen=True)
class VerifyResult:
    dest: str
    source: str
    num_files: int
    num_bytes: int
    elapsed_s: float


def verify_staged(dest: str | os.PathLike, *, src: str | os.PathLike | None = None, workers: int = 8,
                  progress: bool = False, full: bool = True) -> VerifyResult:
    """Check a staged copy against its manifest; raise StagedDataError unless every file matches.

    full (default): re-hash every file. full=False: re-hash only files whose stat signature (size, mtime,
    inode, ctime) moved since their last check; the rest are taken as checked (manifest.py says what that
    cannot see). A copy whose staging did not finish, or (given `src`) that holds another dataset, is refused
    too. Waits while a `stage` into `dest` is running.
    """
    start = time.monotonic()
    dest_path = Path(os.path.realpath(dest))
    if not dest_path.is_dir():
        raise StagedDataError("no staged copy here: the folder does not exist", where=str(dest_path),
                              fix="stage the dataset first: embodyhpc stage SRC DEST")
    announce = print_stderr if progress else None
    with dest_lock(dest_path, exclusive=False, announce=announce):
        manifest = load_manifest(dest_path)
        if manifest is None:
            raise StagedDataError(f"no staging manifest ({MANIFEST_NAME}): not a staged copy, or staging never "
                                  "started", where=str(dest_path), fix="stage the dataset: embodyhpc stage SRC DEST")
        fix = f"run `embodyhpc stage {manifest.source} {dest_path}`; it copies only what is missing or damaged"
        if src is not None and os.path.realpath(src) != manifest.source:
            raise StagedDataError(f"holds a copy of {manifest.source}, not of {os.path.realpath(src)}",
                                  where=str(dest_path), fix=f"stage {src} into a folder of its own")
        if not manifest.complete:
            raise StagedDataError(f"staging did not finish ({len(manifest.files)} files copied so far)",
                                  where=str(dest_path), fix=fix)
        with ThreadPoolExecutor(workers, thread_name_prefix="embodyhpc-verify") as pool:
            problems, _ = verify_files(str(dest_path), manifest.files, manifest.chunk_bytes, pool,
                                       window=workers * TASKS_PER_WORKER, progress=progress, trust_signature=not full)
        if problems:
            raise damaged_error(str(dest_path), problems, fix)
    return VerifyResult(str(dest_path), manifest.source, len(manifest.files),
                        sum(e.size for e in manifest.files.values()), time.monotonic() - start)


def verify_files(dest: str, entries: dict[str, FileEntry], chunk_bytes: int, pool: Executor, *, window: int,
                 progress: bool, from_device: bool = False, trust_signature: bool = False,
                 ) -> tuple[list[tuple[str, str]], dict[str, Signature]]:
    """Check staged files against their entries: (sorted problems as (relative path, what is wrong),
    {relative path: signature} of each file whose content was re-hashed and matched).

    trust_signature: a file whose stat signature equals the one recorded at its last check is not read.
    from_device: read past the page cache (see transfer.hash_batch); sync the filesystem first.
    """
    problems: dict[str, str] = {}
    matched: dict[str, Signature] = {}
    to_hash: list[SourceFile] = []
    for rel, entry in entries.items():
        try:
            st = os.stat(os.path.join(dest, rel), follow_symlinks=False)
        except FileNotFoundError:
            problems[rel] = "missing"
            continue
        except OSError as exc:
            problems[rel] = f"unreadable ({exc.strerror or exc})"
            continue
        if not stat.S_ISREG(st.st_mode):
            problems[rel] = "not a regular file"
        elif st.st_size != entry.size:  # cheap, and catches truncation before any hashing
            problems[rel] = f"{st.st_size} bytes, expected {entry.size}"
        elif (trust_signature and entry.checked and st.st_mtime_ns == entry.staged_mtime_ns
              and st.st_ino == entry.dest_ino and st.st_ctime_ns == entry.dest_ctime_ns):
            continue
        else:
            to_hash.append(SourceFile(rel, entry.size, entry.mtime_ns, 0))
    to_hash.sort(key=lambda f: f.size, reverse=True)
    leaves: dict[str, dict[int, tuple[bytes, Signature] | str]] = {}

    def work(task: WholeFiles | Chunk) -> object:
        if isinstance(task, Chunk):
            return transfer.hash_chunk(dest, task, from_device)
        return transfer.hash_batch(dest, task, from_device)

    def on_result(task: WholeFiles | Chunk, result: object) -> None:
        if isinstance(task, WholeFiles):
            assert isinstance(result, list)
            for f, (rel, digest, problem, signature) in zip(task.files, result, strict=True):
                bar.advance(f.size, 1)
                if problem is not None or digest != entries[rel].hash:
                    problems[rel] = problem or _HASH_MISMATCH
                elif signature is not None:
                    matched[rel] = signature
            return
        rel = task.file.rel
        digests = leaves.setdefault(rel, {})
        digests[task.index] = result  # (leaf digest, signature), or what went wrong reading it
        bar.advance(task.length)
        if len(digests) < num_leaves(task.file.size, chunk_bytes):
            return
        bar.advance(0, 1)
        failures = [d for d in digests.values() if isinstance(d, str)]
        if failures:
            problems[rel] = failures[0]
            return
        ordered = [digests[i] for i in range(len(digests))]
        signatures = {sig for _, sig in ordered}  # type: ignore[misc]
        if root_hash(digest for digest, _ in ordered) != entries[rel].hash:  # type: ignore[misc]
            problems[rel] = _HASH_MISMATCH
        elif len(signatures) == 1:  # every chunk read the same, unchanged file
            matched[rel] = signatures.pop()

    with Progress("verify", sum(f.size for f in to_hash), len(to_hash), enabled=progress) as bar:
        run_tasks(pool, make_tasks(to_hash, chunk_bytes), work, on_result, window=window)
    return sorted(problems.items()), matched


def damaged_error(dest: str, problems: list[tuple[str, str]], fix: str) -> StagedDataError:
    shown = "; ".join(f"{rel}: {what}" for rel, what in problems[:5])
    more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
    return StagedDataError(f"{len(problems)} staged file(s) do not match the manifest, never train on them: "
                           f"{shown}{more}", problems=problems, where=dest, fix=fix)


def print_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
