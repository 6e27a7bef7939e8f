"""The checkpoint folder on the parallel filesystem, and the rules that make it safe to read while jobs die.

    checkpoints/
        step-200/               DCP files of model + optimizer (.metadata, __<rank>_0.distcp)
            trainer.json        step, sampler state, extra trainer state (identical on every rank; rank 0 writes it)
            rng/rank-00000.pt   RNG states of each rank (per rank by nature: each rank draws its own noise)
            .complete           the marker: written by rank 0 after EVERY rank finished writing
            pins/<owner>        evaluations waiting to export this step: retention keeps the folder meanwhile
        step-300/               no marker: a save in flight, or the leftover of a crash; never read
        latest                  "step-200": names the newest complete folder; replaced atomically

Truth is the marker, not `latest`: a job can die between writing a marker and updating `latest`, so resume scans
for markers. `latest` is for people and tools (`--ckpt RUN/checkpoints/$(cat RUN/checkpoints/latest)`). It is a
small file rather than a symlink because symlinks do not survive every copy of a run directory (object stores,
`cp -r` to some filesystems, archives), and a file replaced with os.replace is just as atomic.

A folder's step is its own record, not only its name: the marker (and trainer.json) hold the step that was saved,
and `checkpoint_step` refuses a folder whose name says another (a `step-8` holding step 4's checkpoint would make a
resume skip steps 5-8). Folder names go through one parser, rundir.parse_step, for the planner and the loader
alike: `step-N` exactly as step_name writes it. A near miss (`step-0004`, `step-+4`, a step past int64) is not a
step folder; `misnamed` says what is wrong with one, so that a complete checkpoint under such a name is refused
with its true name rather than passed over in silence.

Everything here is plain filesystem code without collectives: the Checkpointer decides which rank calls it.
One training job writes a checkpoint folder at a time (Slurm requeues, it never runs two copies of one job), so
an unmarked folder found when no save is in flight is a crash leftover.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embodyhpc.atomic import replace_atomically, write_json_atomic
from embodyhpc.rundir import MAX_STEP, STEP_PREFIX, parse_step, step_name

MARKER = ".complete"
LATEST = "latest"
TRAINER_JSON = "trainer.json"
RNG_DIR = "rng"
PINS_DIR = "pins"
_RETIRING_PREFIX = ".retiring-"  # folders renamed away before deletion: invisible to readers at once
MAX_RECORD_BYTES = 1 << 20  # a marker or trainer.json of ours is a few KiB (trainer.json holds the sampler state)


@dataclass(frozen=True)
class Listing:
    """Step folders found under a checkpoint root, each list sorted by step."""

    complete: list[int]
    incomplete: list[int]
    misnamed: tuple[str, ...] = ()
    """Folders named like a step but not as step_name writes one (`misnamed`), by name."""

    @property
    def newest_complete(self) -> int | None:
        return self.complete[-1] if self.complete else None


def step_dir(root: Path, step: int) -> Path:
    return root / step_name(step)


def rng_file(folder: Path, rank: int) -> Path:
    return folder / RNG_DIR / f"rank-{rank:05d}.pt"


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def list_steps(root: Path) -> Listing:
    complete: list[int] = []
    incomplete: list[int] = []
    misnamed: list[str] = []
    if root.is_dir():
        for entry in root.iterdir():
            step = parse_step(entry.name)
            if not entry.is_dir():
                continue
            if step is None:
                if misnamed_step(entry.name) is not None:
                    misnamed.append(entry.name)
                continue
            (complete if is_complete(entry) else incomplete).append(step)
    return Listing(sorted(complete), sorted(incomplete), tuple(sorted(misnamed)))


def misnamed_step(name: str) -> str | None:
    """Why `name` looks like a step folder and is none (None: it is one, or looks like none): what a person who
    renamed or copied a folder by hand should know."""
    if not name.startswith(STEP_PREFIX) or parse_step(name) is not None:
        return None
    rest = name[len(STEP_PREFIX):]
    if rest.isascii() and rest.isdigit():
        if len(rest) > 1 and rest.startswith("0") and int(rest) <= MAX_STEP:
            return f"a step written with leading zeros (embodyhpc writes {step_name(int(rest))})"
        return f"a step past {MAX_STEP} (the largest a checkpoint's step can be: ranks agree on it as int64)"
    try:
        int(rest)
    except ValueError:
        return None
    return f"not a step as embodyhpc writes one ({STEP_PREFIX}N: ASCII digits, no sign, space or separator)"


def checkpoint_step(folder: Path) -> int:
    """The step a complete checkpoint folder holds, from its own record (the marker; trainer.json too when there
    is one), after checking that the folder's name says the same. Refuses (NotACheckpointError, one line) a folder
    whose records disagree with its name or with each other, or hold no step: training from it would restart at
    a step it does not hold."""
    from embodyhpc.checkpoint.errors import NotACheckpointError

    def refuse(problem: str, fix: str = "move this folder out of checkpoints/; resume from a checkpoint whose "
                                        "folder name and record agree") -> NotACheckpointError:
        return NotACheckpointError(problem, where=str(folder), fix=fix)

    named = parse_step(folder.name)
    if named is None:
        why = misnamed_step(folder.name) or f"not a {STEP_PREFIX}N folder name"
        raise refuse(why, fix="rename it as embodyhpc writes step folders, or move it out of checkpoints/")
    recorded = {}
    for name, required in ((MARKER, True), (TRAINER_JSON, False)):
        path = folder / name
        if not path.is_file():
            if required:
                raise refuse(f"no {MARKER} marker: not a complete checkpoint")
            continue
        step = _recorded_step(path)
        if isinstance(step, str):
            raise refuse(f"{name} {step}")
        if step is not None:
            recorded[name] = step
    if not recorded:
        raise refuse(f"neither {MARKER} nor {TRAINER_JSON} records the step it holds")
    for name, step in recorded.items():
        if step != named:
            raise refuse(f"the folder is named {step_name(named)} but its {name} records step {step} (renamed or "
                         f"copied by hand?): resuming would claim steps it never trained")
    return named


def _recorded_step(path: Path) -> int | str | None:
    """The "step" of a JSON record; None when it has none; a string saying what is wrong otherwise."""
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            return f"is larger than {MAX_RECORD_BYTES >> 20} MiB: not a record embodyhpc writes"
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return f"is unreadable ({exc.strerror if isinstance(exc, OSError) else 'not valid JSON'})"
    if not isinstance(data, dict):
        return "is not a JSON object"
    if "step" not in data:
        return None
    step = data["step"]
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        return f"records step {str(step)[:40]!s}, not a whole number from 0 to {MAX_STEP}"
    return step


def write_marker(folder: Path, info: dict[str, Any]) -> None:
    """The last write of a save: after it the folder counts. Atomic, so a reader never sees half a marker."""
    write_json_atomic(folder / MARKER, info)


def read_marker(folder: Path) -> dict[str, Any]:
    return json.loads((folder / MARKER).read_text())


def write_latest(root: Path, step: int) -> None:
    """Point `latest` at step-N by replacing the file whole (os.replace is atomic on POSIX filesystems)."""
    replace_atomically(root / LATEST, lambda tmp: tmp.write_text(step_name(step) + "\n"))


def read_latest(root: Path) -> Path | None:
    """The folder `latest` names, or None when there is no pointer yet."""
    try:
        name = (root / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return root / name if parse_step(name) is not None else None


def plan_retention(listing: Listing, keep_latest_k: int, in_flight: int | None = None) -> list[int]:
    """Steps whose folders may go: complete ones beyond the newest `keep_latest_k`, and unmarked crash leftovers.

    The newest complete folder is never chosen whatever `keep_latest_k` says (it is what a restart resumes from),
    and neither is the folder of a save in flight (unmarked because it is still being written).
    """
    keep = max(keep_latest_k, 1)
    old_complete = listing.complete[:-keep] if len(listing.complete) > keep else []
    leftovers = [step for step in listing.incomplete if step != in_flight]
    return sorted(old_complete + leftovers)


def pin(folder: Path, owner: str | Path) -> bool:
    """Keep `folder` from retention until `owner` (an evaluation run directory) unpins it. Written by whoever creates
    the evaluation (the training job's rank 0, or `embodyhpc eval --ckpt`); removed by its export job.

    False when the folder cannot be written (a read-only or someone else's checkpoint): it stays unpinned, and the
    evaluation reads it all the same (its export job writes elsewhere)."""
    pins = folder / PINS_DIR
    try:
        pins.mkdir(exist_ok=True)
        (pins / _pin_name(owner)).write_text(f"{owner}\n")
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return False
        from embodyhpc.checkpoint.errors import NotACheckpointError

        raise NotACheckpointError(f"cannot pin the checkpoint for this evaluation ({exc.strerror or exc})",
                                  where=str(pins), fix="check that folder (pins/ must be a folder)") from None
    return True


def unpin(folder: Path, owner: str | Path) -> None:
    """Idempotent; a folder retention already removed is fine too."""
    try:
        (folder / PINS_DIR / _pin_name(owner)).unlink()
    except FileNotFoundError:
        pass


def pinned_by(folder: Path) -> list[str]:
    """The owners (evaluation run directories) holding `folder`."""
    pins = folder / PINS_DIR
    return sorted(p.read_text().strip() for p in pins.iterdir()) if pins.is_dir() else []


def _pin_name(owner: str | Path) -> str:
    """One file per owner; owners are paths, so the name is a digest of it (no slashes, bounded length)."""
    import hashlib

    return hashlib.sha256(str(owner).encode()).hexdigest()[:24]


def remove_folder(folder: Path) -> None:
    """Rename first, then delete: readers scanning the root never see a half-deleted step folder as a step."""
    if not folder.exists():
        return
    retiring = folder.with_name(f"{_RETIRING_PREFIX}{folder.name}-{uuid.uuid4().hex[:8]}")
    os.replace(folder, retiring)
    shutil.rmtree(retiring, ignore_errors=True)


def remove_retiring_leftovers(root: Path) -> None:
    """Finish deletions a crash interrupted (they are already invisible, this only frees the space)."""
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(_RETIRING_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
