"""`stage(src, dest)`: mirror a dataset folder onto node-local storage, resumably and verified.

One run, under an exclusive lock on DEST (runs into the same folder take turns, never interleave):
1. list SRC and DEST (stat only) and load the manifest. A file is kept without reading it when the manifest
   recorded the source's current size, mtime and inode, and the staged file still has the size, mtime, inode
   and ctime recorded when its content was last checked (manifest.py: what that signature can and cannot see);
   a staged file with the right size and mtime whose inode or ctime moved is re-hashed (`verify="quick"`);
2. check free space for what is left to copy, before changing anything;
3. delete the staged files SRC no longer has (those the manifest lists, and partial files left by a killed run),
   create folders; a file in DEST that neither SRC nor the manifest knows is never deleted: the run refuses in
   one line before changing anything (tree.refuse_unstaged_removals);
4. copy the rest in parallel, hashing each byte as it is copied (the source is read once), recording each
   finished file in the manifest, which is rewritten every MANIFEST_FLUSH_INTERVAL_S and whenever the run
   stops: a killed run resumes from the last manifest, and a file the manifest does not list counts for nothing;
5. re-hash what the verify mode asks for (quick: staged files whose signature moved; full: every staged file,
   read past the page cache), copy damaged ones again and re-check them;
6. mark the manifest complete (`verify_staged` refuses a copy whose manifest is not).

Crash safety without an fsync per file: files are written without fsync, and every manifest write that adds
files is preceded by one syncfs(2) of DEST's filesystem. The manifest (written atomically, fsynced) therefore
only ever lists files whose data is already durable; a file written but not yet listed is copied again by the
next run, whatever state a crash left it in.

Verify modes (`verify=`, `staging.verify`, `embodyhpc stage --verify`):
- "quick" (default; also `True`): the content hash is taken from the bytes as they are copied, and restaging
  trusts a staged file only while its stat signature is unchanged since that hash (or a later re-hash), so an
  unchanged tree restages with a stat walk and no reads. Catches truncation, deletion and any write, chmod or
  utime to a staged file (ctime moves), and any change to the source; does not catch bit rot or device-level
  corruption that leaves metadata alone.
- "full": additionally re-hashes every staged file on every run, reading from the device rather than the page
  cache (fadvise DONTNEED after the sync): one local read of the dataset per run, catches bit rot too.
- "none" (also `False`): never reads staged files; trusts size and mtime alone.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from embodyhpc.staging import manifest as manifest_module
from embodyhpc.staging import transfer
from embodyhpc.staging.dest import (  # noqa: F401  (SPACE_MARGIN_*: hw/preflight reads them from here)
    SPACE_MARGIN_BYTES,
    SPACE_MARGIN_FRACTION,
    check_free_space,
    check_paths,
    make_dest,
    on_local_filesystem,
    undo_unstaged_dest,
)
from embodyhpc.staging.errors import StageInputError, StagingError
from embodyhpc.staging.lock import LOCK_NAME, LockReplacedError, dest_lock
from embodyhpc.staging.manifest import (
    CONTROL_PREFIX,
    MANIFEST_NAME,
    PARTIAL_SUFFIX,
    FileEntry,
    Manifest,
    load_manifest,
    manifest_path,
    num_leaves,
    sync_filesystem,
    write_manifest,
)
from embodyhpc.staging.progress import Progress, format_bytes, format_rate
from embodyhpc.staging.transfer import Chunk, Copied, WholeFiles, make_tasks, run_tasks
from embodyhpc.staging.tree import Plan, SourceFile, make_plan, refuse_unstaged_removals, scan_dest, scan_source
from embodyhpc.staging.verify import TASKS_PER_WORKER, damaged_error, print_stderr, verify_files

MANIFEST_FLUSH_INTERVAL_S = 2.0
"""At most this much finished copying is redone after a kill (the manifest cost is ~10 ms per 10k files)."""
RACY_NS = 20_000_000
"""A manifest is written at least this long after the newest ctime it records. Timestamps come from a coarse
kernel clock (one tick: up to 10 ms); were a staged file changed in the tick its signature was taken in, its
ctime would not move. Waiting two ticks before the manifest is written means any change after the manifest
exists gets a later ctime (the same race git calls racy-clean)."""
SERIAL_BELOW_BYTES = 1024 * 1024
"""From a fast source (its stats answer in microseconds, tree.SourceListing.fast, and it is on a local filesystem,
on_local_filesystem), batches of files smaller than this on average are copied by one thread while larger
files use every worker. Copying a small file from such a
source is CPU work under Python's GIL; more threads only add GIL hand-offs (10,000 files of 1-16 KiB from the page
cache to tmpfs on 2 cores: 0.63-0.69 s on one thread, 1.26-1.27 s across 8). From a parallel filesystem every
open and stat waits on a server, and all workers overlap those waits."""
VERIFY_MODES = ("quick", "full", "none")
_VERIFY_ALIASES = {"true": "quick", "yes": "quick", "on": "quick", "1": "quick",
                   "false": "none", "no": "none", "off": "none", "0": "none"}

_LOCK_ATTEMPTS = 5
"""A run waiting on the lock retries when the run before it removed the folder it was waiting in."""


def verify_mode(verify: bool | str) -> str:
    """"quick", "full" or "none" from a verify argument or recipe value (True: quick, False: none)."""
    if verify is True:
        return "quick"
    if verify is False:
        return "none"
    text = str(verify).strip().lower()
    text = _VERIFY_ALIASES.get(text, text)
    if text not in VERIFY_MODES:
        raise StageInputError(f"verify must be one of {', '.join(VERIFY_MODES)} (or true/false), got {verify!r}",
                              key="staging.verify", fix="use quick (the default), full or none")
    return text


@dataclass(frozen=True)
class StageResult:
    src: str
    dest: str
    num_files_copied: int
    num_files_skipped: int
    """Unchanged since the last run: not copied again."""
    num_files_removed: int
    """Gone from the source, so deleted from the staged copy."""
    num_bytes_copied: int
    elapsed_s: float
    verified: bool
    """Every staged file is known to match its manifest hash: hashed as it was copied, re-hashed in this run, or
    (quick) unchanged in stat since such a check. False with verify="none"."""
    num_files_repaired: int = 0
    """Staged files that failed verification and were copied again (counted in num_files_copied as well)."""
    verify: str = "quick"
    """The verify mode of the run (stage.py's docstring)."""
    num_files_rehashed: int = 0
    """Staged files read and re-hashed in this run (rechecks, every file with verify="full", repairs)."""
    copy_s: float = 0.0
    """Seconds spent copying (the phases the progress bar shows): the copy rate is over these, as the bar's is, not
    over elapsed_s, which adds scanning, verification and the final flush."""

    def summary(self) -> str:
        return (f"staged {self.src} -> {self.dest}: {self.num_files_copied} files copied "
                f"({format_bytes(self.num_bytes_copied)} at {format_rate(self.num_bytes_copied, self.copy_s)}), "
                f"{self.num_files_skipped} unchanged, "
                f"{self.num_files_removed} removed, {self.num_files_repaired} repaired, "
                f"{self.num_files_rehashed} re-hashed, {'verified' if self.verified else 'not verified'} "
                f"({self.verify}), {self.elapsed_s:.1f} s")


def stage(src: str | os.PathLike, dest: str | os.PathLike, *, workers: int = 8, verify: bool | str = "quick",
          progress: bool = True, summary: bool = True) -> StageResult:
    """Mirror the folder `src` into `dest` (created if missing) and return what was done.

    workers: copy threads. verify: "quick" (default, True), "full" or "none" (False), see the module docstring:
    quick re-hashes only staged files whose stat signature moved, full re-hashes the whole staged copy from
    the device, none trusts size and mtime. Files that do not match are copied again. progress: a bar on a
    terminal, a line every 10 s otherwise, and (summary) a summary line at the end, all on stderr; `embodyhpc stage`
    prints its summary on stdout instead.
    Raises StageInputError (bad arguments), NotEnoughSpaceError (before anything is copied), StagingError,
    and StagedDataError when a file still differs after being copied again.
    """
    start = time.monotonic()
    mode = verify_mode(verify)
    src_path, dest_path = check_paths(src, dest)
    if workers < 1:
        raise StageInputError(f"workers must be at least 1, got {workers}", key="staging.copy_workers",
                              fix="use 8 or more on a parallel filesystem")
    gc_was_enabled = gc.isenabled()
    gc.disable()  # tens of thousands of small records and no cycles: collections would only cost time
    try:
        for attempt in range(_LOCK_ATTEMPTS):
            created = make_dest(dest_path)
            lock_was_there = (dest_path / LOCK_NAME).exists()
            try:
                with dest_lock(dest_path, exclusive=True, announce=print_stderr if progress else None):
                    try:
                        with ThreadPoolExecutor(workers, thread_name_prefix="embodyhpc-stage") as pool, \
                                ThreadPoolExecutor(1, thread_name_prefix="embodyhpc-stage-small") as serial:
                            result = _StageRun(str(src_path), str(dest_path), pool, workers, progress,
                                               serial).run(mode, start)
                    except BaseException:
                        undo_unstaged_dest(dest_path, created=created, lock_was_there=lock_was_there)
                        raise
                break
            except LockReplacedError:
                if attempt == _LOCK_ATTEMPTS - 1:
                    raise
    finally:
        if gc_was_enabled:
            gc.enable()
    if progress and summary:
        print_stderr(result.summary())
    return result


class _StageRun:
    """One staging run; the manifest is only touched from the thread that calls `run`."""

    def __init__(self, src: str, dest: str, pool: Executor, workers: int, progress: bool,
                 serial: Executor | None = None) -> None:
        self.src = src
        self.dest = dest
        self.pool = pool
        self.serial = serial
        """Where small files of a fast source are copied (SERIAL_BELOW_BYTES); None: everything goes to `pool`."""
        self.fast_stats = False
        self.window = workers * TASKS_PER_WORKER
        self.progress = progress
        self.copy_s = 0.0  # time in _copy, for the summary's rate
        self.manifest = Manifest(src)
        self._flushed_at = 0.0
        self._unsynced = False
        """Files were recorded since the last sync: sync before the manifest lists them."""
        self._newest_ctime_ns = 0

    def run(self, mode: str, start: float) -> StageResult:
        previous = self._previous_manifest()
        chunk_bytes = manifest_module.CHUNK_BYTES
        src_files, src_dirs, self.fast_stats = scan_source(self.src, self.pool, self.dest)
        dest_files, dest_dirs = scan_dest(self.dest)
        # entries describe this source's files only if made from it with the same hash leaves
        trusted = previous is not None and previous.source == self.src and previous.chunk_bytes == chunk_bytes
        recorded = previous.files if previous is not None and trusted else {}
        plan = make_plan(src_files, src_dirs, dest_files, dest_dirs, recorded)
        staged = previous.files if previous is not None else {}
        refuse_unstaged_removals(self.dest, plan, staged)
        check_free_space(self.dest, plan)

        # files to delete stay listed until they are gone: a run killed before deleting them still knows they are its
        leaving = {rel: staged[rel] for rel in plan.remove_files if rel in staged}
        self.manifest = Manifest(self.src, chunk_bytes, {**leaving, **{rel: recorded[rel] for rel in plan.unchanged}})
        dirty = bool(plan.to_copy or plan.remove_files or plan.remove_dirs or plan.make_dirs
                     or previous is None or not trusted or len(recorded) != len(plan.unchanged))
        was_complete = previous is not None and previous.complete
        was_verified = previous is not None and previous.verified
        if dirty or not was_complete:
            self._flush()  # complete=False from here until this run finishes
        self._remove(plan)
        for rel in leaving:
            del self.manifest.files[rel]
        num_bytes = self._copy(plan.to_copy, "copy")
        damaged: list[SourceFile] = []
        rehashed = 0
        resigned = False
        if mode != "none":
            if mode == "full":
                self._sync()  # cached pages must be clean before they can be dropped and read from the device
                to_check = self.manifest.files
            else:
                to_check = {rel: self.manifest.files[rel] for rel in plan.recheck}
            rehashed = len(to_check)
            problems, matched = verify_files(self.dest, to_check, chunk_bytes, self.pool, window=self.window,
                                             progress=self.progress, from_device=mode == "full")
            resigned = self._record_signatures(matched)
            damaged = [src_files[rel] for rel, _ in problems]
            if damaged:
                for f in damaged:
                    del self.manifest.files[f.rel]
                self._flush()
                num_bytes += self._copy(damaged, "repair")
                rehashed += len(damaged)
                still, matched = verify_files(self.dest, {f.rel: self.manifest.files[f.rel] for f in damaged},
                                              chunk_bytes, self.pool, window=self.window, progress=False,
                                              from_device=True)
                self._record_signatures(matched)
                if still:
                    raise damaged_error(self.dest, still, "check the node-local disk (dmesg, SMART): these files "
                                        "were copied again and still differ")
        self.manifest.complete = True
        # a copy verified earlier stays verified as long as nothing in it changes
        self.manifest.verified = mode != "none" or (was_verified and not dirty and not plan.recheck)
        if dirty or damaged or resigned or not was_complete or self.manifest.verified != was_verified:
            self._flush()
        repaired_unchanged = len({f.rel for f in damaged} & set(plan.unchanged))
        return StageResult(
            src=self.src, dest=self.dest, num_files_copied=len(plan.to_copy) + repaired_unchanged,
            num_files_skipped=len(plan.unchanged) - repaired_unchanged,
            num_files_removed=sum(not rel.endswith(PARTIAL_SUFFIX) for rel in plan.remove_files),
            num_bytes_copied=num_bytes, elapsed_s=time.monotonic() - start, verified=mode != "none",
            num_files_repaired=len(damaged), verify=mode, num_files_rehashed=rehashed, copy_s=self.copy_s)

    def _record_signatures(self, matched: dict[str, tuple[int, int]]) -> bool:
        """Record the signatures of re-hashed files that matched; True when any entry changed."""
        changed = False
        for rel, (ino, ctime_ns) in matched.items():
            entry = self.manifest.files[rel]
            if (entry.dest_ino, entry.dest_ctime_ns) != (ino, ctime_ns):
                self.manifest.files[rel] = replace(entry, dest_ino=ino, dest_ctime_ns=ctime_ns)
                self._newest_ctime_ns = max(self._newest_ctime_ns, ctime_ns)
                changed = True
        return changed

    def _previous_manifest(self) -> Manifest | None:
        if not manifest_path(Path(self.dest)).exists():
            foreign = sorted(e.name for e in os.scandir(self.dest) if not e.name.startswith(CONTROL_PREFIX))
            if foreign:
                shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
                raise StageInputError(f"the destination is not empty ({shown}) and staging did not create it "
                                      f"(no {MANIFEST_NAME}); staging deletes what the source lacks, so it refuses",
                                      where=self.dest, fix="stage into a new or empty folder, or delete this one")
            return None
        try:
            return load_manifest(Path(self.dest))
        except StagingError:
            return None  # unreadable, but its name says staging made this folder: everything is re-copied

    def _remove(self, plan: Plan) -> None:
        try:
            for rel in plan.remove_files:
                try:
                    os.unlink(os.path.join(self.dest, rel))
                except FileNotFoundError:
                    pass
            for rel in plan.remove_dirs:
                shutil.rmtree(os.path.join(self.dest, rel))
            for rel in plan.make_dirs:
                os.makedirs(os.path.join(self.dest, rel), exist_ok=True)
        except OSError as exc:
            raise StagingError(f"cannot update the staged folder ({exc.strerror or exc})",
                               where=str(exc.filename or self.dest), fix="check the folder's permissions") from exc

    def _copy(self, files: list[SourceFile], label: str) -> int:
        """Copy `files`, recording each in the manifest as it completes; returns the bytes copied."""
        if not files:
            return 0
        chunk_bytes = self.manifest.chunk_bytes
        leaves: dict[str, dict[int, bytes]] = {}
        num_bytes = 0

        def start_large(f: SourceFile) -> None:
            transfer.start_large_copy(self.dest, f)
            leaves[f.rel] = {}

        def work(task: WholeFiles | Chunk) -> object:
            if isinstance(task, Chunk):
                return transfer.copy_chunk(self.src, self.dest, task)
            return transfer.copy_batch(self.src, self.dest, task)

        def on_result(task: WholeFiles | Chunk, result: object) -> None:
            nonlocal num_bytes
            if isinstance(task, WholeFiles):
                assert isinstance(result, tuple)
                copied, error = result
                for f, done in zip(task.files, copied, strict=False):  # a failed batch returns a prefix
                    num_bytes += self._record(f, done)
                    bar.advance(done.size, 1)
                if error is not None:
                    raise error
            else:
                assert isinstance(result, bytes)
                digests = leaves[task.file.rel]
                digests[task.index] = result
                bar.advance(task.length)
                if len(digests) == num_leaves(task.file.size, chunk_bytes):
                    ordered = [digests[i] for i in range(len(digests))]
                    done = transfer.finish_large_copy(self.src, self.dest, task.file, ordered)
                    num_bytes += self._record(task.file, done)
                    bar.advance(0, 1)
            if time.monotonic() - self._flushed_at >= MANIFEST_FLUSH_INTERVAL_S:
                self._flush()

        route = None
        if self.fast_stats and self.serial is not None and on_local_filesystem(self.src):
            serial, pool = self.serial, self.pool

            def route(task: WholeFiles | Chunk) -> Executor:
                small = isinstance(task, WholeFiles) and sum(f.size for f in task.files) < SERIAL_BELOW_BYTES * len(
                    task.files)
                return serial if small else pool

        bar = Progress(label, sum(f.size for f in files), len(files), enabled=self.progress)
        try:
            with bar:
                try:
                    run_tasks(self.pool, make_tasks(files, chunk_bytes, start_large), work, on_result,
                              window=self.window, route=route)
                except BaseException:
                    self._flush()  # what finished stays finished, however the run stops (run() writes it on success)
                    raise
        finally:
            self.copy_s += bar.seconds  # the bar's own duration: its closing rate and the summary's are one number
        return num_bytes

    def _record(self, f: SourceFile, copied: Copied) -> int:
        self.manifest.files[f.rel] = FileEntry(copied.size, f.mtime_ns, copied.hash, copied.dest_mtime_ns,
                                               f.ino or None, copied.dest_ino, copied.dest_ctime_ns)
        self._unsynced = True
        if copied.dest_ctime_ns is not None and copied.dest_ctime_ns > self._newest_ctime_ns:
            self._newest_ctime_ns = copied.dest_ctime_ns
        return copied.size

    def _sync(self) -> None:
        if self._unsynced:
            try:
                sync_filesystem(self.dest)
            except OSError as exc:
                raise StagingError(f"cannot flush the staged files to disk ({exc.strerror or exc})",
                                   where=self.dest, fix="check the node-local disk (dmesg)") from exc
            self._unsynced = False

    def _flush(self) -> None:
        """Write the manifest: after the data of every file it lists is durable, and after RACY_NS."""
        self._sync()
        wait_ns = self._newest_ctime_ns + RACY_NS - time.time_ns()
        if wait_ns > 0:
            time.sleep(wait_ns / 1e9)
        write_manifest(Path(self.dest), self.manifest)
        self._flushed_at = time.monotonic()

