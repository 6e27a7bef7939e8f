"""Whether a path may take a new dataset folder: checked before anything is simulated, written or created.

    from embodyhpc.data.output_dir import check_output_dir
    check_output_dir("/data/demos", overwrite=False, key="--out")   # DatasetError naming --out and the fix

The writer (embodyhpc.data.writer) runs the same checks when it starts; `embodyhpc data synth` runs them first, so
a bad --out costs no simulation. Standard library only: the CLI imports this without numpy or pyarrow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from embodyhpc.data.errors import DatasetError
from embodyhpc.data.formats import LEROBOT_CODEBASE_VERSION

__all__ = ["TEMPORARY_SUFFIX_BYTES", "WRITING_MARKER", "check_output_dir", "display_path", "not_replaceable"]

WRITING_MARKER = ".embodyhpc-writing"  # in a dataset folder the writer has not finished
_WRITTEN_ENTRIES = {"meta", "data", "videos", WRITING_MARKER}
TEMPORARY_SUFFIX_BYTES = 24
"""Room a folder name needs for the writer's siblings: `.NAME.writing-PID` and `.NAME.replaced-PID` (PIDs up to
Linux's 4194304), so --overwrite can write the new dataset beside the old one."""
_DEEPEST_FILE_BYTES = 160
"""Room the path needs for the files inside a dataset (videos/observation.images.<camera>/chunk-000/file-000.mp4)."""


def display_path(path: str | os.PathLike) -> str:
    """The path as an error message shows it: as typed, or Python's ascii() of it when it holds a control character
    or something not printable (a one-line error must stay one line and show what is really there)."""
    text = os.fspath(path)
    return text if text.isprintable() else ascii(text)


def _limits(existing: Path) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) in bytes of the filesystem holding `existing`; POSIX Linux's 255 and 4096 if unknown."""
    try:
        return os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 255, 4096


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor or ".")


def check_output_dir(root: str | os.PathLike, *, overwrite: bool = False, key: str = "out") -> None:
    """Raise a DatasetError (naming `key`, the path and the fix) unless `root` can take a new dataset folder: a path
    that does not exist yet (its parent folders are made) or an empty folder, or with `overwrite` a dataset this
    writer wrote. Refused: an empty path, control characters, a name or path too long for the filesystem, a file or
    a link in its place, a non-empty folder (without `overwrite`), a folder --overwrite must not delete, and a place
    this process cannot write to. Creates nothing."""
    text = os.fspath(root)
    where = display_path(text)
    if not text.strip():
        raise DatasetError("empty path", key=key, fix="name the new dataset folder, e.g. --out ./demos")
    if not text.isprintable():
        raise DatasetError(f"the path {where} holds a control or unprintable character (a newline or tab from a "
                           "script?)", key=key, fix="name the folder with printable characters only")
    path = Path(text)
    if path.name != path.name.strip():
        raise DatasetError(f"the folder name {path.name!r} starts or ends with a space (a quoting mistake?)",
                           where=where, key=key, fix="remove the spaces, or pick another name")
    absolute = Path(os.path.abspath(path))
    existing = _nearest_existing(absolute)
    name_max, path_max = _limits(existing if existing.is_dir() else existing.parent)
    too_long = [p for p in absolute.parts if len(os.fsencode(p)) > name_max]
    if too_long:
        raise DatasetError(f"a folder name of {len(os.fsencode(too_long[0]))} bytes; this filesystem takes "
                           f"{name_max}", where=where[:80] + "...", key=key, fix="use shorter folder names")
    if len(os.fsencode(absolute.name)) > name_max - TEMPORARY_SUFFIX_BYTES:
        raise DatasetError(f"the folder name is {len(os.fsencode(absolute.name))} bytes; at most "
                           f"{name_max - TEMPORARY_SUFFIX_BYTES} leave room for the writer's temporary siblings",
                           where=where[:80] + "...", key=key, fix="use a shorter folder name")
    if len(os.fsencode(str(absolute))) > path_max - _DEEPEST_FILE_BYTES:
        raise DatasetError(f"the absolute path is {len(os.fsencode(str(absolute)))} bytes; at most "
                           f"{path_max - _DEEPEST_FILE_BYTES} leave room for the files inside a dataset "
                           f"(PATH_MAX {path_max})", where=where[:80] + "...", key=key,
                           fix="pick a shorter path")
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise DatasetError("exists and is not a folder" + (" (a symbolic link)" if path.is_symlink() else ""),
                           where=where, key=key, fix="pick a new path for the dataset")
    if not path.exists():
        if not existing.is_dir():
            raise DatasetError(f"cannot create the dataset folder: {display_path(existing)} is "
                               f"{'a broken link' if existing.is_symlink() else 'a file'}, not a folder", where=where,
                               key=key, fix="pick a path under a folder")
        _check_writable(existing, where, key)
        return
    try:
        entries = any(path.iterdir())
    except OSError as exc:
        raise DatasetError(f"cannot list the folder: {exc.strerror or exc}", where=where, key=key,
                           fix="pick a folder you can read and write") from None
    if not entries:
        _check_writable(path, where, key)
        return
    if not overwrite:
        raise DatasetError("folder exists and is not empty", where=where, key=key,
                           fix="pick a new path, or pass --overwrite to replace the dataset in it")
    why = not_replaceable(path)
    if why:
        raise DatasetError(f"--overwrite refused: {why}", where=where, key=key,
                           fix="pick a new path (or delete that folder yourself if it really should go)")
    _check_writable(absolute.parent, where, key)  # the new dataset is written beside the old one, then swapped in


def _check_writable(folder: Path, where: str, key: str) -> None:
    # access() answers for this process's user and for read-only mounts (EROFS), root included.
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DatasetError(f"cannot create the dataset folder: {display_path(folder)} is not writable by this user"
                           + (" (a read-only filesystem?)" if os.geteuid() == 0 else ""), where=where, key=key,
                           fix="pick a path in a folder you can write to")


def not_replaceable(root: Path) -> str | None:
    """Why `root` is not a dataset folder the writer wrote (so --overwrite must not delete it); None if it is."""
    resolved = root.resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
        return "it is the filesystem root or your home folder"
    if resolved == Path.cwd().resolve() or resolved in Path.cwd().resolve().parents:
        return "it holds the current folder"
    others = sorted(p.name for p in root.iterdir() if p.name not in _WRITTEN_ENTRIES)
    if others:
        return f"it holds {', '.join(others[:3])}{' ...' if len(others) > 3 else ''}, which no dataset of ours has"
    if (root / WRITING_MARKER).is_file():
        return None  # an unfinished dataset of ours
    info = root / "meta" / "info.json"
    try:
        version = json.loads(info.read_text()).get("codebase_version")
    except (OSError, ValueError, AttributeError):
        return f"no readable {info.relative_to(root)}: not a LeRobot dataset"
    if version != LEROBOT_CODEBASE_VERSION:
        return f"meta/info.json says codebase_version {str(version)[:20]!r}, not {LEROBOT_CODEBASE_VERSION!r}"
    return None
