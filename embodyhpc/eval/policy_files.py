"""What exported weights carry besides the weights and their recipe, checked before an evaluation feeds the policy.

Training writes these side files next to its checkpoints (train/loop.py write_policy_io); every export copies them
and records their sha256 in export.json (checkpoint/integrity.py):

    normalization.json     the state statistics the policy was trained with (data/normalize.py)
    policy_io.json         the dataset's cameras, their image size, the state key, the real action dims, fps
    tokenizer.model|json   the tokenizer file training read, when it read one

`check_policy_files(files, model)` reads the first two and refuses, in one line naming the file, the field and the
fix, what would fail every episode or silently evaluate another policy: a field of the wrong type, statistics with
a NaN or a negative scale, a state key or a normalisation other than the recipe's, more action dims than the model
predicts, no statistics where the recipe normalises. `check_suite(policy, model, eval)` refuses a suite that does
not render a camera the policy reads or takes actions of another size. `embodyhpc eval --ckpt` runs both before it
creates anything (embodyhpc.evaluate); the export job runs the first before it writes, and every shard again when it
loads the policy (eval/trained.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embodyhpc.config.schema import EvalConfig, ModelConfig
from embodyhpc.data.normalize import NORM_FILE, StateNormalizer
from embodyhpc.errors import UserError
from embodyhpc.eval.task_names import suite_action_dim, suite_cameras
from embodyhpc.models.checkpoint_assets import TOKENIZER_FILES
from embodyhpc.rundir import POLICY_IO_FILE, read_policy_io

SIDE_FILES = (NORM_FILE, POLICY_IO_FILE, *TOKENIZER_FILES)
"""Every file an export's behaviour depends on besides model.safetensors and config.yaml."""
REEXPORT = "export the checkpoint again (embodyhpc eval --ckpt RUN/checkpoints/step-N), or repair the file"


@dataclass(frozen=True)
class PolicyFiles:
    """What the side files say, checked."""

    normalizer: StateNormalizer
    """The statistics the policy was trained with (mode none when it was trained without)."""
    cameras: tuple[str, ...] = ()
    """The dataset's cameras: the policy reads observation.images.<camera> for each (none: state only)."""
    image_size: int | None = None
    action_dim: int | None = None
    """The real action dims (the model predicts model.action_dim, zero-padded); None: all of them."""
    io: dict[str, Any] = field(default_factory=dict)
    """policy_io.json as written."""
    io_file: Path | None = None
    """Where policy_io.json was read (None: there is none)."""


def find_side_files(folders: Sequence[Path]) -> dict[str, Path | None]:
    """{name: the file of that name in the first of `folders` that has one, or None} for every SIDE_FILES name."""
    return {name: next((Path(f) / name for f in folders if (Path(f) / name).is_file()), None) for name in SIDE_FILES}


def check_policy_files(files: Mapping[str, Path | None], model: ModelConfig, *, where: str) -> PolicyFiles:
    """The side files `files` names (find_side_files), checked on their own and against the model the weights are
    built as (the weights' recipe: config.yaml of an export, resolved.yaml of a checkpoint's run); `where` names
    the folder they were looked for in."""
    io_path = files.get(POLICY_IO_FILE)
    io = read_policy_io(io_path.parent) if io_path is not None else {}
    io_where = str(io_path)
    cameras = io.get("cameras", [])
    if cameras is None:
        cameras = []
    if not isinstance(cameras, list) or not all(isinstance(c, str) and c.strip() and "/" not in c for c in cameras):
        raise UserError(f"not a list of camera names ({str(cameras)[:60]})", where=io_where, key="cameras",
                        fix=REEXPORT)
    if len(set(cameras)) != len(cameras):
        raise UserError(f"a camera is listed twice ({cameras})", where=io_where, key="cameras", fix=REEXPORT)
    image_size = _optional_int(io, "image_size", io_where)
    action_dim = _optional_int(io, "action_dim", io_where)
    fps = io.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < float("inf")):
        raise UserError(f"{fps!r} is not a frame rate", where=io_where, key="fps", fix=REEXPORT)
    state_key = io.get("state_key")
    if state_key is not None and state_key != model.state_key:
        raise UserError(f"the policy reads {state_key!r}, the weights' recipe says model.state_key="
                        f"{model.state_key}", where=io_where, key="state_key", fix=REEXPORT)
    if action_dim is not None and action_dim > model.action_dim:
        raise UserError(f"{action_dim} action dims, but the weights predict model.action_dim={model.action_dim}",
                        where=io_where, key="action_dim", fix=REEXPORT)
    return PolicyFiles(_normalizer(files.get(NORM_FILE), model, where), tuple(cameras), image_size, action_dim, io,
                       io_path)


def _optional_int(io: dict[str, Any], key: str, where: str) -> int | None:
    value = io.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise UserError(f"{value!r} is not a positive integer", where=where, key=key, fix=REEXPORT)
    return value


def _normalizer(path: Path | None, model: ModelConfig, folder: str) -> StateNormalizer:
    normalizer = StateNormalizer.load(path.parent) if path is not None else None
    if normalizer is None:
        if model.state_norm != "none":
            raise UserError(f"the weights were trained with model.state_norm={model.state_norm}, and no "
                            f"{NORM_FILE} carries the statistics (the policy would see raw states)",
                            where=folder, fix="export the checkpoint again (it copies the statistics training "
                            "used)")
        return StateNormalizer(model.state_key, "none")
    where = str(path)
    if normalizer.mode != model.state_norm:
        raise UserError(f"statistics for {normalizer.mode}, the weights' recipe normalises with model.state_norm="
                        f"{model.state_norm}", where=where, key="mode", fix=REEXPORT)
    if normalizer.mode != "none" and normalizer.key != model.state_key:
        raise UserError(f"statistics of {normalizer.key!r}, the weights' recipe reads model.state_key="
                        f"{model.state_key}", where=where, key="key", fix=REEXPORT)
    if model.state_input == "expert" and len(normalizer.offset) > model.state_dim:
        raise UserError(f"statistics of a {len(normalizer.offset)}-dim state, the model takes model.state_dim="
                        f"{model.state_dim}", where=where, key="offset", fix=REEXPORT)
    return normalizer


def check_suite(policy: PolicyFiles, model: ModelConfig, ev: EvalConfig, *, where: str) -> None:
    """The evaluation's suite can feed this policy and take its actions; `where` names the side files' folder."""
    rendered = suite_cameras(ev.suite)
    if rendered is not None:
        missing = [c for c in policy.cameras if c not in rendered]
        if missing:
            raise UserError(f"the policy reads camera {missing[0]!r}, which the {ev.suite} suite does not render "
                            f"(it renders {', '.join(rendered)})", where=str(policy.io_file or where),
                            key="cameras", related=("eval.suite",),
                            fix="evaluate on the suite the training dataset was recorded in (--suite)")
        video = ev.suite_options.get("video_camera")
        if video is not None and video not in rendered:
            raise UserError(f"{video!r} is not a camera of the {ev.suite} suite", key="eval.suite_options.video_camera",
                            fix=f"use one of {', '.join(rendered)}")
    dims = policy.action_dim or model.action_dim
    takes = suite_action_dim(ev.suite)
    if takes is not None and dims != takes:
        raise UserError(f"the policy acts in {dims} dims (policy_io.json action_dim, else model.action_dim), the "
                        f"{ev.suite} suite takes {takes}", where=where, key="eval.suite",
                        fix="evaluate on the suite the training dataset was recorded in (--suite)")
