"""What the copy threads run: copy-and-hash or re-hash whole small files and chunks of large ones.

I/O goes through os.read/os.readv/os.write in BLOCK_BYTES pieces (large reads into a reused per-thread buffer):
the GIL is released during each call, so threads overlap on the filesystem, and XXH3 hashes at memory speed.
Small files travel in batches to keep per-task overhead off the 10,000-small-files case; files above
`chunk_bytes` are split into one task per hash leaf, so a single huge file uses every worker.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass
from typing import TypeVar

from embodyhpc.staging.errors import NotEnoughSpaceError, StagingError
from embodyhpc.staging.manifest import PARTIAL_SUFFIX, leaf_hasher, root_hash
from embodyhpc.staging.tree import SourceFile

BLOCK_BYTES = 4 * 1024 * 1024
_BUFFERED_READ_BYTES = 256 * 1024
"""Reads at least this long go into a reused per-thread buffer: a fresh 4 MiB bytes object per read costs an
allocation and ~1,000 page faults, a measurable share of copying a large file; small reads stay plain."""
_local = threading.local()
BATCH_MAX_FILES = 64
BATCH_MAX_BYTES = 16 * 1024 * 1024
_OPEN_READ = os.O_RDONLY | os.O_CLOEXEC
_OPEN_WRITE = os.O_WRONLY | os.O_CLOEXEC

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class WholeFiles:
    """Small files (each at most one hash leaf), handled one after the other by one worker."""

    files: tuple[SourceFile, ...]


@dataclass(frozen=True)
class Chunk:
    """One hash leaf of a large file."""

    file: SourceFile
    index: int
    offset: int
    length: int


@dataclass(frozen=True)
class Copied:
    rel: str
    size: int
    hash: str
    dest_mtime_ns: int | None
    """Only where the destination's filesystem stored a different mtime than the source's."""
    dest_ino: int | None = None
    dest_ctime_ns: int | None = None
    """The staged file's inode and ctime once in place (manifest.py: the restage signature)."""


def _read_umask() -> int | None:
    """This process's umask from /proc (os.umask can only read it by changing it, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


_UMASK = _read_umask()


def partial_path(dest_root: str, rel: str) -> str:
    return os.path.join(dest_root, rel) + PARTIAL_SUFFIX


def make_tasks(files: Iterable[SourceFile], chunk_bytes: int,
               on_large_file: Callable[[SourceFile], None] | None = None) -> Iterator[WholeFiles | Chunk]:
    """Tasks for `files` in their order; `on_large_file` runs just before the first chunk of a large file."""
    batch: list[SourceFile] = []
    batch_bytes = 0
    for f in files:
        if f.size > chunk_bytes:
            if on_large_file is not None:
                on_large_file(f)
            for index, offset in enumerate(range(0, f.size, chunk_bytes)):
                yield Chunk(f, index, offset, min(chunk_bytes, f.size - offset))
            continue
        batch.append(f)
        batch_bytes += f.size
        if len(batch) >= BATCH_MAX_FILES or batch_bytes >= BATCH_MAX_BYTES:
            yield WholeFiles(tuple(batch))
            batch, batch_bytes = [], 0
    if batch:
        yield WholeFiles(tuple(batch))


def run_tasks(pool: Executor, tasks: Iterable[T], fn: Callable[[T], R], on_result: Callable[[T, R], None],
              *, window: int, route: Callable[[T], Executor] | None = None) -> None:
    """Run `fn` over `tasks` on the pool with at most `window` in flight; `on_result` runs on this thread.

    route: picks the executor of each task instead (stage.py sends small files from a fast source to one thread).

    On the first failure (in a task, in `on_result`, or while making tasks) nothing new starts, the tasks
    already running finish and still reach `on_result` (so finished files get recorded), then the failure
    is raised.
    """
    pending: dict[Future, T] = {}
    iterator = iter(tasks)
    error: BaseException | None = None
    exhausted = False
    try:
        while True:
            while error is None and not exhausted and len(pending) < window:
                try:
                    task = next(iterator)
                except StopIteration:
                    exhausted = True
                except Exception as exc:
                    error = exc
                else:
                    pending[(pool if route is None else route(task)).submit(fn, task)] = task
            if not pending:
                break
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                task = pending.pop(future)
                try:
                    on_result(task, future.result())
                except Exception as exc:
                    error = error or exc
        if error is not None:
            raise error
    finally:
        for future in pending:
            future.cancel()


# --- copying ---------------------------------------------------------------------------------------------


def copy_batch(src_root: str, dest_root: str, task: WholeFiles) -> tuple[list[Copied], Exception | None]:
    """Copy each file of the batch; a failure stops the batch but what was copied before it is returned."""
    copied = []
    for f in task.files:
        try:
            copied.append(copy_file(src_root, dest_root, f))
        except Exception as exc:
            return copied, exc
    return copied, None


def copy_file(src_root: str, dest_root: str, f: SourceFile) -> Copied:
    """Copy one file of at most one hash leaf, hashing the bytes as they pass (the source is read once).

    A new name is written in place (O_EXCL): until the manifest lists it, a file at its final name counts for
    nothing (a killed run leaves it unlisted and the next run copies it again). A name that exists already
    (a file being replaced, or an unlisted leftover) is written to `<name>.embodyhpc.partial` and renamed over
    it, so a process still reading the old file keeps seeing whole old content. No fsync here: stage() syncs
    the filesystem once before the manifest lists the file.
    """
    src_path = os.path.join(src_root, f.rel)
    dest_path = os.path.join(dest_root, f.rel)
    wanted_mode = stat.S_IMODE(f.mode) | 0o600
    tmp: str | None = None
    leaf = leaf_hasher()
    num_bytes = 0
    try:
        fd_in = os.open(src_path, _OPEN_READ)
        try:
            try:
                fd_out = os.open(dest_path, _OPEN_WRITE | os.O_CREAT | os.O_EXCL, wanted_mode)
                chmod = _UMASK is None or wanted_mode & ~_UMASK != wanted_mode
            except FileExistsError:
                tmp = dest_path + PARTIAL_SUFFIX
                fd_out = os.open(tmp, _OPEN_WRITE | os.O_CREAT | os.O_TRUNC, 0o600)
                chmod = True
            try:
                while num_bytes < f.size:
                    data = _read(fd_in, min(BLOCK_BYTES, f.size - num_bytes))
                    if not data:
                        break
                    leaf.update(data)
                    _write_all(fd_out, data)
                    num_bytes += len(data)
                _check_unchanged(f, os.fstat(fd_in), num_bytes, src_path)
                dest_mtime_ns, st = _set_metadata(fd_out, f, chmod=chmod)
            except BaseException:
                if tmp is None:  # never leave a torn file at the final name when we can help it
                    _unlink_quietly(dest_path)
                raise
            finally:
                os.close(fd_out)
        finally:
            os.close(fd_in)
        if tmp is not None:
            os.rename(tmp, dest_path)
            st = os.stat(dest_path)  # rename moves ctime on most filesystems
    except OSError as exc:
        raise copy_error(exc, src_path, dest_root) from exc
    return Copied(f.rel, num_bytes, root_hash([leaf.digest()]), dest_mtime_ns, st.st_ino, st.st_ctime_ns)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def start_large_copy(dest_root: str, f: SourceFile) -> None:
    """Create the (sparse) partial file that the chunks of a large file are written into."""
    tmp = partial_path(dest_root, f.rel)
    try:
        fd = os.open(tmp, _OPEN_WRITE | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, f.size)
        finally:
            os.close(fd)
    except OSError as exc:
        raise copy_error(exc, tmp, dest_root) from exc


def copy_chunk(src_root: str, dest_root: str, task: Chunk) -> bytes:
    """Copy one leaf of a large file into its partial file at the same offset; returns the leaf digest."""
    src_path = os.path.join(src_root, task.file.rel)
    leaf = leaf_hasher()
    try:
        fd_in = os.open(src_path, _OPEN_READ)
        try:
            fd_out = os.open(partial_path(dest_root, task.file.rel), _OPEN_WRITE)
            try:
                pos, end = task.offset, task.offset + task.length
                while pos < end:
                    data = _read(fd_in, min(BLOCK_BYTES, end - pos), pos)
                    if not data:
                        raise _changed(src_path)
                    leaf.update(data)
                    _write_all(fd_out, data, pos)
                    pos += len(data)
            finally:
                os.close(fd_out)
        finally:
            os.close(fd_in)
    except OSError as exc:
        raise copy_error(exc, src_path, dest_root) from exc
    return leaf.digest()


def finish_large_copy(src_root: str, dest_root: str, f: SourceFile, leaves: list[bytes]) -> Copied:
    """After every chunk landed: check the source did not change meanwhile, set metadata, rename into place."""
    src_path = os.path.join(src_root, f.rel)
    tmp = partial_path(dest_root, f.rel)
    try:
        _check_unchanged(f, os.stat(src_path), f.size, src_path)
        fd = os.open(tmp, _OPEN_WRITE)
        try:
            dest_mtime_ns, _ = _set_metadata(fd, f)
        finally:
            os.close(fd)
        dest_path = os.path.join(dest_root, f.rel)
        os.rename(tmp, dest_path)
        st = os.stat(dest_path)
    except OSError as exc:
        raise copy_error(exc, src_path, dest_root) from exc
    return Copied(f.rel, f.size, root_hash(leaves), dest_mtime_ns, st.st_ino, st.st_ctime_ns)


def _read(fd: int, length: int, offset: int | None = None) -> bytes | memoryview:
    """Up to `length` bytes from fd (at `offset`, else at its position); valid until this thread reads again."""
    if length < _BUFFERED_READ_BYTES:
        return os.read(fd, length) if offset is None else os.pread(fd, length, offset)
    buffer = getattr(_local, "buffer", None)
    if buffer is None or len(buffer) < length:
        buffer = _local.buffer = memoryview(bytearray(max(length, BLOCK_BYTES)))
    view = buffer[:length]
    num_bytes = os.readv(fd, [view]) if offset is None else os.preadv(fd, [view], offset)
    return view[:num_bytes]


def _write_all(fd: int, data: bytes | memoryview, offset: int | None = None) -> None:
    view = memoryview(data)
    done = 0
    while done < len(view):
        if offset is None:
            done += os.write(fd, view[done:])
        else:
            done += os.pwrite(fd, view[done:], offset + done)


def _set_metadata(fd: int, f: SourceFile, *, chmod: bool = True) -> tuple[int | None, os.stat_result]:
    """Give the staged file the source's mode and mtime; returns (its mtime if it differs, its stat)."""
    # owner read/write added so staging can always re-read (verify) and replace what it wrote; skipped where
    # the file was created with that mode already (the umask left it alone)
    if chmod:
        os.fchmod(fd, stat.S_IMODE(f.mode) | 0o600)
    os.utime(fd, ns=(f.mtime_ns, f.mtime_ns))
    st = os.fstat(fd)
    return (None if st.st_mtime_ns == f.mtime_ns else st.st_mtime_ns), st


def _check_unchanged(f: SourceFile, st: os.stat_result, num_bytes: int, src_path: str) -> None:
    if num_bytes != f.size or st.st_size != f.size or st.st_mtime_ns != f.mtime_ns:
        raise _changed(src_path)


def _changed(src_path: str) -> StagingError:
    return StagingError("the source file changed while it was being copied", where=src_path,
                        fix="wait until nothing writes to the dataset, then stage again (it resumes)")


def copy_error(exc: OSError, path: str, dest_root: str) -> StagingError:
    if exc.errno == errno.ENOSPC:
        return NotEnoughSpaceError("the destination filesystem filled up while copying", where=dest_root,
                                   fix="free space there or stage to a bigger filesystem; staging resumes")
    where = exc.filename if isinstance(exc.filename, str) else path
    return StagingError(f"copy failed: {exc.strerror or exc}", where=where,
                        fix="fix the cause and stage again (finished files are not copied again)")


# --- verification ----------------------------------------------------------------------------------------


Signature = tuple[int, int]
"""(inode, ctime_ns) of a staged file, taken before its content was read for a check."""


def _drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Ask the kernel to forget the file's clean cached pages, so the next read comes from the device."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def hash_batch(dest_root: str, task: WholeFiles, from_device: bool = False
               ) -> list[tuple[str, str | None, str | None, Signature | None]]:
    """(rel, hash, problem, signature) for each staged small file; hash is None where it could not be read whole.

    from_device: drop the file's cached pages first (they must be clean: sync before), so bit rot on the
    device is seen rather than the page cache's copy of what was written.
    """
    out: list[tuple[str, str | None, str | None, Signature | None]] = []
    for f in task.files:
        leaf = leaf_hasher()
        num_bytes = 0
        try:
            fd = os.open(os.path.join(dest_root, f.rel), _OPEN_READ)
            try:
                st = os.fstat(fd)
                if from_device:
                    _drop_cached(fd)
                while data := _read(fd, BLOCK_BYTES):
                    leaf.update(data)
                    num_bytes += len(data)
            finally:
                os.close(fd)
        except OSError as exc:
            out.append((f.rel, None, f"unreadable ({exc.strerror or exc})", None))
            continue
        if num_bytes != f.size:
            out.append((f.rel, None, f"{num_bytes} bytes, expected {f.size}", None))
        else:
            out.append((f.rel, root_hash([leaf.digest()]), None, (st.st_ino, st.st_ctime_ns)))
    return out


def hash_chunk(dest_root: str, task: Chunk, from_device: bool = False) -> tuple[bytes, Signature] | str:
    """(leaf digest, signature) of one chunk of a staged large file, or a problem description."""
    leaf = leaf_hasher()
    try:
        fd = os.open(os.path.join(dest_root, task.file.rel), _OPEN_READ)
        try:
            st = os.fstat(fd)
            pos, end = task.offset, task.offset + task.length
            if from_device:
                _drop_cached(fd, pos, task.length)
            while pos < end:
                data = _read(fd, min(BLOCK_BYTES, end - pos), pos)
                if not data:
                    return f"ends at byte {pos}, expected {task.file.size}"
                leaf.update(data)
                pos += len(data)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    return leaf.digest(), (st.st_ino, st.st_ctime_ns)
