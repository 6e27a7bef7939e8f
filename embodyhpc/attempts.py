"""What an attempt leaves when `embodyhpc resume` starts the next: moved to attempts/N whole, never overwritten.

A resume moves what attempt N wrote that attempt N+1 would overwrite (rundir.ATTEMPT_OUTPUTS: its resolved.yaml,
scripts/, export/, evaluation results) to attempts/N. It does so in steps that a crash at any point leaves
recoverable, with run.json as the commit point:

1. stage: the outputs are renamed into a hidden folder beside attempts/N (attempts/.N.staging-<hex>), resolved.yaml
   copied (the old one stays in place);
2. the new resolved.yaml replaces the old one whole, and run.json records attempt N+1 (the commit);
3. the staging folder is renamed to attempts/N in one step.

A staging folder found later says where a resume stopped (`recover`): run.json still at attempt N (before the
commit) -> its contents go back where they came from, resolved.yaml included; run.json at N+1 or later (after the
commit) -> the rename of step 3 is done. An existing attempts/N is never written into: it belongs to an attempt
run.json does not know (a run.json restored from a backup, or a resume of an older embodyhpc that stopped half-way),
and resume refuses before touching anything (`check_free`).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

from embodyhpc.errors import RunDirError
from embodyhpc.rundir import (
    ATTEMPT_OUTPUTS,
    ATTEMPTS_DIR,
    RESOLVED_YAML,
    attempt_dir,
    attempt_staging_dir,
    staged_attempts,
    write_private,
)

MAX_LISTED = 5


def _exists(path: Path) -> bool:
    return os.path.lexists(path)


def check_free(run: Path, newest: int) -> None:
    """Refuse (one line, nothing touched) when attempts/<newest> or a later one exists already: archiving the newest
    attempt there would overwrite what an attempt run.json does not record left."""
    root = Path(run) / ATTEMPTS_DIR
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RunDirError(f"cannot read {ATTEMPTS_DIR}/: {exc.strerror or exc}", where=str(root),
                          fix="check the folder's permissions") from None
    taken = sorted(int(name) for name in names if name.isascii() and name.isdigit() and int(name) >= newest)
    if not taken:
        return
    first = attempt_dir(run, taken[0])
    raise RunDirError(f"exists already, but run.json records attempt {newest} as the newest: archiving "
                      f"attempt {newest} would overwrite what an attempt run.json does not know left there (run.json "
                      "restored from a backup, or an older embodyhpc's resume that stopped half-way)",
                      where=str(first),
                      fix=f"restore the run.json that recorded attempt {taken[-1] + 1}; or, if attempt {newest} is "
                          f"what should go on, move {first} aside (mv {first} {first}.kept) and resume again")


def stage(run: Path, number: int) -> Path:
    """Step 1: attempt `number`'s outputs into a fresh staging folder (resolved.yaml copied, the rest renamed).
    Whatever goes wrong on the way is put back before the error propagates."""
    staging = attempt_staging_dir(run, number, uuid.uuid4().hex[:16])
    staging.parent.mkdir(mode=0o700, exist_ok=True)
    staging.mkdir(mode=0o700)
    try:
        for name in ATTEMPT_OUTPUTS:
            source = Path(run) / name
            if not _exists(source):
                continue
            if name == RESOLVED_YAML:  # the new attempt's jobs read the rewritten one; a copy goes to the archive
                write_private(staging / name, source.read_text())
                continue
            (staging / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            source.rename(staging / name)
    except BaseException:
        put_back(run, staging)
        raise
    return staging


def commit(run: Path, number: int, staging: Path) -> Path:
    """Step 3: staging -> attempts/<number>, one rename (never onto an existing archive: check_free ran)."""
    target = attempt_dir(run, number)
    if _exists(target):
        raise RunDirError(f"{target} appeared while this resume ran; attempt {number}'s outputs stay in {staging}",
                          where=str(target), fix=f"compare the two and keep one as {target}")
    os.rename(staging, target)
    return target


def put_back(run: Path, staging: Path) -> None:
    """Undo `stage`: every output back where it came from (resolved.yaml replaced whole by the staged copy, which
    is the old one), then the staging folder removed. A place taken meanwhile is refused, nothing overwritten."""
    for name in ATTEMPT_OUTPUTS:
        staged, target = staging / name, Path(run) / name
        if not _exists(staged):
            continue
        if name == RESOLVED_YAML:
            os.replace(staged, target)
            continue
        if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
            target.rmdir()  # an empty folder the interrupted resume made in its place
        if _exists(target):
            raise RunDirError(f"cannot put {staged} back: {target} exists (both are kept)", where=str(staging),
                              fix=f"keep the one you want as {target} and remove {staging}")
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        staged.rename(target)
    _remove_empty(staging)


def recover(run: Path, newest: int, progress: Callable[[str], None]) -> None:
    """Finish or undo what a resume that died half-way left (module docstring), given run.json's newest attempt."""
    for number, staging in staged_attempts(run):
        if number == newest:  # run.json never recorded the next attempt: as if that resume had not started
            put_back(run, staging)
            progress(f"note: a resume of {run} stopped before recording attempt {number + 1}: attempt {number}'s "
                     "outputs and resolved.yaml are back in place")
        elif number < newest and not _exists(attempt_dir(run, number)):
            commit(run, number, staging)
            progress(f"note: a resume of {run} stopped after recording attempt {number + 1}: attempt {number}'s "
                     f"outputs are now in {attempt_dir(run, number)}")
        else:
            raise RunDirError(f"a staging folder of attempt {number} that run.json (newest attempt {newest}) cannot "
                              "place" + (f", and {attempt_dir(run, number)} exists too" if number < newest else ""),
                              where=str(staging), fix=f"compare it with {attempt_dir(run, number)}, keep what you "
                                                      f"need, and remove {staging}")


def pending(run: Path) -> list[Path]:
    """The staging folders an interrupted resume left (what `recover` would finish or undo)."""
    return [path for _, path in staged_attempts(run)]


def _remove_empty(folder: Path) -> None:
    """Remove `folder` and its empty subfolders; anything left in it is refused (never deleted)."""
    for path in sorted((p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink()),
                       key=lambda p: len(p.parts), reverse=True):
        try:
            path.rmdir()
        except OSError:
            pass
    try:
        folder.rmdir()
    except OSError:
        left = sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))[:MAX_LISTED]
        raise RunDirError(f"holds files no attempt output has: {', '.join(left)}", where=str(folder),
                          fix="move them where they belong and remove the folder") from None
