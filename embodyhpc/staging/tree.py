"""Listing the source and destination trees, and deciding what to copy, keep and delete.

Paths are relative, '/'-separated strings. The source is read through symlinks (a dataset folder of links
to blobs stages as plain files); the destination is read without following them (staging owns its contents).

What the source may link to (`check_source_link`), each refusal a one-line StageInputError (exit code 2) raised
while listing, before anything is copied:
- a regular file anywhere (the blob layout of a hub cache: snapshots/<rev>/x -> ../../blobs/<hash>);
- a folder inside the source (links that leave it would copy trees nobody asked for: a home, a filesystem root);
- never the destination, anything inside it, or a folder holding it: staging would copy its own output (nested
  link/link/... copies and its lock file);
- never a loop, a missing target, a kernel pseudo-file (/proc, /sys, /dev) or a special file.
Special files in the source itself (fifos, sockets, devices) are refused too: reading a fifo blocks forever, and
a dataset that names one would fail later, on the node.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import NamedTuple

from embodyhpc.staging.errors import StageInputError
from embodyhpc.staging.manifest import CONTROL_PREFIX, PARTIAL_SUFFIX, FileEntry

_STAT_BATCH = 64
"""Source stats per task. On a parallel filesystem every stat waits on a metadata round trip, so a restage (stats
only) is as parallel as its batches: 64 keeps 16 workers busy from ~1,000 files on, for ~3 ms of task overhead per
10,000 files on a local disk (256 left 2,000 files to 8 tasks: a restage behind 0.5 ms of latency took 0.84 s
instead of ~0.3 s)."""
_PROBE_STATS = 16
_INLINE_STAT_S = 50e-6
"""Sources whose first _PROBE_STATS stats average less than this are stat'ed on the calling thread. A local or
page-cached filesystem answers in 2-10 us and threads there cost more than they hide (a restage of 10,000 files:
stats 0.13-0.17 s through 8 threads, ~0.05 s on one); a parallel filesystem's metadata round trip is 100 us or
more, and there the pool overlaps them."""



class SourceFile(NamedTuple):
    """One source file as listed (a NamedTuple: a restage makes one per file, and a tuple is the cheapest record)."""

    rel: str
    size: int
    mtime_ns: int
    mode: int
    ino: int = 0


class DestFile(NamedTuple):
    size: int
    mtime_ns: int
    regular: bool
    ino: int = 0
    ctime_ns: int = 0


@dataclass
class Plan:
    to_copy: list[SourceFile] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    """Source and staged file unchanged since the staged one was last checked: kept without reading it."""
    recheck: list[str] = field(default_factory=list)
    """Source unchanged and the staged file has the right size and mtime, but its inode or ctime moved since
    its last check (or none was recorded): kept if re-hashing it matches the manifest, else copied again.
    Also in `unchanged`."""
    remove_files: list[str] = field(default_factory=list)
    """Destination files not in the source (old files, strays, leftover partial copies), deleted first."""
    remove_dirs: list[str] = field(default_factory=list)
    """Destination folders not in the source (outermost only), deleted after those files."""
    make_dirs: list[str] = field(default_factory=list)
    bytes_freed: int = 0

    @property
    def num_bytes_to_copy(self) -> int:
        return sum(f.size for f in self.to_copy)


def _walk(root: str, *, follow_symlinks: bool,
          check_link: Callable[[os.DirEntry], None] | None = None) -> Iterator[tuple[str, str, os.DirEntry]]:
    """(kind, relative path, entry) for every entry under root; kind is "dir", "file" or "other".

    Staging's own entries at the top (CONTROL_PREFIX...) are left out. A symlink to a folder that contains
    it is refused rather than followed forever; when following links, `check_link` sees every symlink first.
    """
    root_st = os.stat(root)
    stack: list[tuple[str, str, frozenset]] = [("", root, frozenset({(root_st.st_dev, root_st.st_ino)}))]
    while stack:
        rel_dir, path, parents = stack.pop()
        with os.scandir(path) as entries:
            for entry in entries:
                if not rel_dir and entry.name.startswith(CONTROL_PREFIX):
                    continue
                rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
                if follow_symlinks and check_link is not None and entry.is_symlink():
                    check_link(entry)
                if entry.is_dir(follow_symlinks=follow_symlinks):
                    yield "dir", rel, entry
                    inner = parents
                    if follow_symlinks:
                        st = entry.stat()
                        if (st.st_dev, st.st_ino) in parents:
                            raise StageInputError("symlink loop: this folder links back to a folder that contains "
                                                  "it", where=entry.path, fix="remove the link or stage its target")
                        inner = parents | {(st.st_dev, st.st_ino)}
                    stack.append((rel, entry.path, inner))
                elif entry.is_file(follow_symlinks=follow_symlinks):
                    yield "file", rel, entry
                else:
                    yield "other", rel, entry


class SourceListing(NamedTuple):
    files: dict[str, SourceFile]
    dirs: list[str]
    fast: bool
    """Its stats answered in microseconds (a local or page-cached filesystem): per-file work there is CPU, which
    Python's GIL serialises, so more threads only add hand-offs."""


_PSEUDO_ROOTS = ("/proc", "/sys", "/dev")
"""Kernel pseudo-filesystems: their "files" report sizes that are not their contents (or are devices)."""


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def check_source_link(entry: os.DirEntry, src: str, dest: str | None) -> None:
    """Refuse a symlink of the source that staging must not follow (module docstring); `src` and `dest` are
    real paths (symlinks resolved)."""
    target = os.path.realpath(entry.path)  # resolves as far as it can, also for a link into a DEST not made yet
    if dest is not None and (_inside(target, dest) or _inside(dest, target)):
        raise StageInputError(f"symlink to the staging destination {dest} (or a folder holding it): staging would "
                              "copy its own output", where=entry.path,
                              fix="remove the link from the dataset or stage to another folder")
    try:
        st = os.stat(entry.path)  # follows the whole chain
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StageInputError("symlink loop: this link resolves to itself", where=entry.path,
                                  fix="remove the link") from None
        raise StageInputError("broken symlink in the dataset", where=entry.path,
                              fix="repair or remove the link; training would fail on it") from None
    if any(_inside(target, root) for root in _PSEUDO_ROOTS):
        raise StageInputError(f"symlink to the kernel pseudo-file {target}, not dataset content", where=entry.path,
                              fix="remove the link")
    if stat.S_ISDIR(st.st_mode) and not _inside(target, src):
        raise StageInputError(f"symlink to the folder {target}, outside the dataset: staging follows folder links "
                              "only within the dataset", where=entry.path,
                              fix="copy that folder into the dataset, or stage it on its own")
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode):
        raise StageInputError(f"symlink to a {_special_kind(st.st_mode)} ({target}), not a dataset file",
                              where=entry.path, fix="remove the link")


def _special_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def scan_source(src: str, pool: Executor, dest: str | None = None) -> SourceListing:
    """The source's files (with size, mtime, mode) and folders; stats run in parallel batches where slow.
    `dest`: the staging destination, which no link of the source may reach."""
    dirs: list[str] = []
    entries: list[tuple[str, os.DirEntry]] = []
    real_src = os.path.realpath(src)
    real_dest = os.path.realpath(dest) if dest is not None else None

    def check_link(entry: os.DirEntry) -> None:
        check_source_link(entry, real_src, real_dest)

    for kind, rel, entry in _walk(src, follow_symlinks=True, check_link=check_link):
        if kind == "dir":
            dirs.append(rel)
        elif kind == "file":
            if rel.endswith(PARTIAL_SUFFIX):
                raise StageInputError(f"file names ending in {PARTIAL_SUFFIX} are reserved for copies in progress",
                                      where=entry.path, fix="rename the file")
            entries.append((rel, entry))
        else:  # links were checked by check_link: this is a fifo, socket or device in the dataset itself
            kind_name = _special_kind(entry.stat(follow_symlinks=False).st_mode)
            raise StageInputError(f"a {kind_name} in the dataset, not a file staging can copy", where=entry.path,
                                  fix="remove it from the dataset folder")

    def stat_batch(batch: list[tuple[str, os.DirEntry]]) -> list[SourceFile]:
        out = []
        for rel, entry in batch:
            st = entry.stat()
            out.append(SourceFile(rel, st.st_size, st.st_mtime_ns, st.st_mode, st.st_ino))
        return out

    # Probe: how long does a stat take here? A page-cached or local source answers in microseconds and is
    # stat'ed on this thread (threads only add GIL hand-offs); a parallel filesystem's round trips go to the pool.
    probe = entries[:_PROBE_STATS]
    started = time.perf_counter()
    listed = [stat_batch(probe)]
    fast = not probe or (time.perf_counter() - started) / len(probe) < _INLINE_STAT_S
    rest = entries[len(probe):]
    if fast:
        listed.append(stat_batch(rest))
    else:
        listed.extend(pool.map(stat_batch, [rest[i:i + _STAT_BATCH] for i in range(0, len(rest), _STAT_BATCH)]))
    files = {f.rel: f for batch in listed for f in batch}
    return SourceListing(files, dirs, fast)


def scan_dest(dest: str) -> tuple[dict[str, DestFile], list[str]]:
    """The destination's files (symlinks and special files count as non-regular files) and folders."""
    files: dict[str, DestFile] = {}
    dirs: list[str] = []
    for kind, rel, entry in _walk(dest, follow_symlinks=False):
        if kind == "dir":
            dirs.append(rel)
        else:
            st = entry.stat(follow_symlinks=False)
            files[rel] = DestFile(st.st_size, st.st_mtime_ns, stat.S_ISREG(st.st_mode), st.st_ino, st.st_ctime_ns)
    return files, dirs


KEEP, RECHECK, COPY = "keep", "recheck", "copy"


def classify(src: SourceFile, entry: FileEntry | None, dest: DestFile | None) -> str:
    """KEEP, RECHECK or COPY one source file, from stat alone (restaging never re-reads the source).

    COPY unless the manifest recorded this very source file (size, mtime and, where both are known, inode)
    and the staged file still has the recorded size and mtime. Then KEEP when the staged file's inode and
    ctime also match those recorded at its last content check (manifest.py: why ctime), else RECHECK.
    """
    if (entry is None or dest is None or not dest.regular or entry.size != src.size
            or entry.mtime_ns != src.mtime_ns or dest.size != entry.size or dest.mtime_ns != entry.staged_mtime_ns):
        return COPY
    if entry.src_ino and src.ino and entry.src_ino != src.ino:
        return COPY
    if entry.dest_ino == dest.ino and entry.dest_ctime_ns == dest.ctime_ns:
        return KEEP
    return RECHECK


def is_unchanged(src: SourceFile, entry: FileEntry | None, dest: DestFile | None) -> bool:
    """Source file and staged file as the manifest recorded them (size and mtime; inode and ctime too)."""
    return classify(src, entry, dest) == KEEP


def make_plan(src_files: dict[str, SourceFile], src_dirs: list[str], dest_files: dict[str, DestFile],
              dest_dirs: list[str], recorded: dict[str, FileEntry]) -> Plan:
    plan = Plan()
    for rel, src in src_files.items():
        kind = classify(src, recorded.get(rel), dest_files.get(rel))
        if kind == COPY:
            plan.to_copy.append(src)
        else:
            plan.unchanged.append(rel)
            if kind == RECHECK:
                plan.recheck.append(rel)
    for rel, dest in dest_files.items():
        if rel not in src_files:
            plan.remove_files.append(rel)
            plan.bytes_freed += dest.size if dest.regular else 0
    wanted_dirs = set(src_dirs)
    for rel in sorted(set(dest_dirs) - wanted_dirs):
        if not plan.remove_dirs or not rel.startswith(plan.remove_dirs[-1] + "/"):
            plan.remove_dirs.append(rel)
    existing = set(dest_dirs) - set(plan.remove_dirs)
    plan.make_dirs = sorted(d for d in wanted_dirs if d not in existing)
    # biggest first: large files start early and small ones fill the gaps at the end
    plan.to_copy.sort(key=lambda f: f.size, reverse=True)
    return plan


def refuse_unstaged_removals(dest: str, plan: Plan, staged: Iterable[str]) -> None:
    """Restaging deletes only what staging put in DEST: the files its manifest lists (`staged`, from whatever source
    they were staged) and partial copies a killed run left. A file the plan would delete that is neither (a user's
    notes, a result written into the staged copy, a link someone made) is never deleted: StageInputError before
    anything changes, naming the files. (A file at a path the source has is replaced by the source's: that is what
    staging is for, and how a killed run's unrecorded copies are redone.)"""
    staged = set(staged)
    foreign = [rel for rel in plan.remove_files if rel not in staged and not rel.endswith(PARTIAL_SUFFIX)]
    if foreign:
        shown = ", ".join(foreign[:3]) + (f", ... ({len(foreign)} in all)" if len(foreign) > 3 else "")
        raise StageInputError(f"the staged folder holds files the source does not have and staging did not put there "
                              f"({shown}); staging never deletes what it did not stage, so it refuses", where=dest,
                              fix="move them out of the staged folder, or stage into another folder")
