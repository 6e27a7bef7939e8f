"""`embodyhpc export --format lerobot`: an embodyhpc export as a LeRobot policy folder, so that LeRobot users can
load what we train. The layout is the model family's: its spec's `lerobot_export` writes it (pi0.5's:
models/pi05/lerobot.py); a family whose spec declares none is refused in one line.

What is the same for every family happens here, around the family's writer: a non-empty --out is refused, the
export is verified (sizes and sha256 of export.json, the weights fit the model its recipe builds), the writer gets
the weights, that model (on the meta device), the recipe's model section, the dataset's features (policy_io.json)
and the state statistics training used (normalization.json); then the tokenizer copy training read, if any, is
copied beside them (model.init_weights of embodyhpc reads the copy).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from embodyhpc.errors import UserError
from embodyhpc.models import available_models, model_spec
from embodyhpc.models.checkpoint_assets import TOKENIZER_FILES, saved_normalizer
from embodyhpc.rundir import read_policy_io


def lerobot_writer(model_name: str, where: str) -> Any:
    """The LeRobot writer of the model family `model_name` (its spec's lerobot_export); a one-line UserError for a
    family without one."""
    spec = model_spec(model_name)
    if spec.lerobot_export is None:
        others = [name for name in available_models() if name != model_name and _has_writer(name)]
        raise UserError(f"{where} holds a {model_name} model, and the {model_name} spec declares no LeRobot exporter",
                        key="model.name", fix=f"export a model of a family that has one ({', '.join(others) or 'none'})"
                                              f", or give the {model_name} spec a lerobot_export (models/spec.py)")
    return spec.load("lerobot_export")


def _has_writer(name: str) -> bool:
    try:
        return model_spec(name).lerobot_export is not None
    except Exception:  # a plug-in that does not load is no suggestion (and not this command's error)
        return False


def export_lerobot(export_dir: str | os.PathLike, out_dir: str | os.PathLike, *, execute_steps: int = 50,
                   strict: bool = True) -> Path:
    """Write `out_dir` (the family's LeRobot policy folder) from a verified embodyhpc export; returns out_dir. The
    family's writer refuses, in one line, what stock LeRobot cannot load (strict=False: only what its layout cannot
    hold; the tests of a layout at a tiny size)."""
    from embodyhpc.checkpoint.export import load_checked_export

    export_dir, out_dir = Path(export_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"{out_dir} exists and is not empty", key="--out", fix="pick a new folder")
    state, _, config, meta = load_checked_export(export_dir)
    write = lerobot_writer(config.model.name, str(export_dir))
    write(out_dir, state, meta, config.model, policy_io=read_policy_io(export_dir),
          normalizer=saved_normalizer(export_dir), execute_steps=execute_steps, **({} if strict else {"strict": False}))
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (export_dir / name).is_file():
            shutil.copy2(export_dir / name, out_dir / name)
    return out_dir


__all__ = ["export_lerobot", "lerobot_writer"]
