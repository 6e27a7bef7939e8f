"""Where a staged copy goes: checking SRC and DEST before anything is touched, the space DEST's filesystem needs,
whether a path's filesystem is local, creating DEST and leaving it as found when a run fails before recording
anything (split from stage.py, which runs the copy)."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from embodyhpc.staging.errors import NotEnoughSpaceError, StageInputError, StagingError
from embodyhpc.staging.lock import LOCK_NAME
from embodyhpc.staging.manifest import manifest_path
from embodyhpc.staging.progress import format_bytes
from embodyhpc.staging.tree import Plan

SPACE_MARGIN_BYTES = 256 * 1024 * 1024
"""Left free beyond what the copy needs: other jobs and logs share node-local disks."""
SPACE_MARGIN_FRACTION = 0.02
_ALLOCATION_BYTES = 4096  # files occupy whole filesystem blocks


def on_local_filesystem(path: str) -> bool:
    """`path` is on a filesystem whose opens and reads never wait on a server (embodyhpc.mounts' "local" kind).

    A network filesystem can answer stats from its client's attribute cache yet still send every open to a metadata
    server (NFS close-to-open, Lustre), so fast stats alone do not make a source local. An unknown mount is not local.
    """
    from embodyhpc.mounts import mount_for, read_mounts

    try:
        mount = mount_for(path, read_mounts())
    except OSError:
        return False
    return mount is not None and mount.kind == "local"


def check_free_space(dest: str, plan: Plan) -> None:
    """Refuse, before copying anything, when DEST's filesystem cannot hold what is left to copy plus a margin.

    Space of files to delete counts as available; space of files being replaced does not (old and new copy
    coexist until the rename), which errs on the safe side.
    """
    if not plan.to_copy:
        return
    allocated = sum(-(-f.size // _ALLOCATION_BYTES) * _ALLOCATION_BYTES for f in plan.to_copy)
    needed = allocated + SPACE_MARGIN_BYTES + int(SPACE_MARGIN_FRACTION * allocated)
    available = shutil.disk_usage(dest).free + plan.bytes_freed
    if needed > available:
        raise NotEnoughSpaceError(
            f"not enough free space: {format_bytes(needed)} needed ({format_bytes(plan.num_bytes_to_copy)} to copy "
            f"in {len(plan.to_copy)} files, plus a margin of {format_bytes(needed - allocated)}), "
            f"{format_bytes(available)} available; nothing was copied", where=dest,
            fix="free space on that filesystem or stage to a bigger one (staging.nvme_dir)")


def make_dest(dest: Path) -> list[Path]:
    """Create DEST and its missing parents; the folders this call created, DEST first (empty: DEST was there)."""
    missing = []
    for folder in (dest, *dest.parents):
        if os.path.exists(folder):  # never raises (Path.exists does, for a folder we may not enter)
            break
        missing.append(folder)
    try:
        dest.mkdir(parents=True)
    except FileExistsError:
        return []  # another run made it in the meantime: it is theirs
    except OSError as exc:  # a path that cannot be a folder is bad input (exit 2, as `data synth --out` says)
        error = StageInputError if exc.errno in _BAD_PATH_ERRNOS else StagingError
        raise error(f"cannot create the destination folder ({exc.strerror})", where=str(dest),
                    fix="pick a writable node-local folder (staging.nvme_dir)") from exc
    return missing


# a path that can never be a folder: the argument is wrong; other errors (EIO, ENOSPC, ...) are failures (exit 1)
_BAD_PATH_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EROFS})


def undo_unstaged_dest(dest: Path, *, created: list[Path], lock_was_there: bool) -> None:
    """After a run that failed before recording anything (no manifest): leave DEST as it was found.

    A folder this run created goes (with the lock file and any partial copy in it), and so do the parents it
    created while they are empty, so a refused source leaves no empty destination behind; in a folder that was
    there, only a lock file this run created goes. Called with the lock held: a run waiting on it notices the lock
    file is gone (LockReplacedError) and starts over. Once a manifest exists the folder is a resumable staged copy
    and stays."""
    if manifest_path(dest).exists():
        return
    try:
        if created:
            shutil.rmtree(dest)
            for parent in created[1:]:
                parent.rmdir()  # only while empty: another run may be using it by now
        elif not lock_was_there:
            (dest / LOCK_NAME).unlink(missing_ok=True)
    except OSError:
        pass  # best effort: the error that brought us here is the one to report


def check_paths(src: str | os.PathLike, dest: str | os.PathLike) -> tuple[Path, Path]:
    src_path = Path(os.path.realpath(src))
    dest_path = Path(os.path.realpath(dest))
    src_stat = _stat_argument(src_path, src, "the dataset folder to stage", "check the path (data.root in the recipe)")
    if src_stat is None:
        raise StageInputError("the dataset folder to stage does not exist", where=str(src),
                              fix="check the path (data.root in the recipe)")
    if not stat.S_ISDIR(src_stat.st_mode):
        raise StageInputError("staging copies a dataset folder, and this is a file", where=str(src),
                              fix="stage the folder that holds it")
    dest_stat = _stat_argument(dest_path, dest, "the destination", "pick a writable node-local folder "
                               "(staging.nvme_dir)")
    if dest_stat is not None and not stat.S_ISDIR(dest_stat.st_mode):
        raise StageInputError("the destination is a file", where=str(dest), fix="give a folder path")
    if dest_path == src_path or dest_path.is_relative_to(src_path) or src_path.is_relative_to(dest_path):
        raise StageInputError(f"source {src_path} and destination {dest_path} overlap",
                              fix="stage into a folder outside the dataset (staging.nvme_dir)")
    return src_path, dest_path


def _stat_argument(path: Path, given: str | os.PathLike, what: str, fix: str) -> os.stat_result | None:
    """os.stat of SRC or DEST, None when it is not there; a path the filesystem refuses is a StageInputError."""
    try:
        return os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise StageInputError(f"cannot use {what}: {exc.strerror or exc}", where=str(given), fix=fix) from None
