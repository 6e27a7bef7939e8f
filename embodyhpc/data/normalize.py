"""State normalisation from a dataset's statistics, shared by training and evaluation.

    norm = StateNormalizer.from_dataset(root, key="observation.state", mode="quantile")
    x = norm(state)                       # numpy or torch, any leading shape
    norm.save(export_dir); StateNormalizer.load(export_dir)

Modes: `none`; `mean_std`: (x - mean) / std; `quantile`: q01 -> -1 and q99 -> +1 (pi0.5's choice: robust to
outliers; values outside are clipped to [-1, 1]). Statistics come from the dataset's meta/stats.json (LeRobot's
format; our writer produces it), or for a LeRobot v2.1 folder from meta/episodes_stats.jsonl aggregated as LeRobot 0.3
does (no quantiles there: `embodyhpc data convert` writes a v3.0 copy with them). A dimension that never varies (std
or q99 - q01 below 1e-6) maps to 0, so a constant input carries no signal instead of a huge one. The statistics are
saved next to exported weights (`normalization.json`): an evaluation normalises with the numbers the policy was
trained with, not with whatever dataset it can find.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embodyhpc.errors import UserError

NORM_MODES = ("none", "mean_std", "quantile")
NORM_FILE = "normalization.json"
_EPS = 1e-6


@dataclass(frozen=True)
class StateNormalizer:
    key: str
    mode: str
    offset: tuple[float, ...] = ()
    """Subtracted first (mean, or the midpoint of q01 and q99)."""
    scale: tuple[float, ...] = ()
    """Then divided by (std, or half of q99 - q01); 0 where a dimension is constant."""

    @classmethod
    def from_stats(cls, stats: dict[str, Any], key: str, mode: str) -> StateNormalizer:
        if mode not in NORM_MODES:
            raise UserError(f"unknown normalisation {mode!r}", key="model.state_norm",
                            fix=f"choose one of {', '.join(NORM_MODES)}")
        if mode == "none":
            return cls(key, mode)
        if key not in stats:
            raise UserError(f"the dataset statistics have no entry for {key!r} (entries: {', '.join(sorted(stats))})",
                            key="model.state_key", fix="name a vector feature of the dataset")
        entry = stats[key]
        lacking = [s for s in (("mean", "std") if mode == "mean_std" else ("q01", "q99")) if s not in entry]
        if lacking:
            raise UserError(f"normalisation {mode!r} needs {' and '.join(lacking)} of {key!r}, and the dataset "
                            f"statistics have only {', '.join(sorted(entry))}", key="model.state_norm",
                            fix="set model.state_norm=mean_std, or convert a LeRobot v2.1 dataset with `embodyhpc "
                                "data convert SRC --to v3.0 --out DST` (it adds the quantiles)")
        if mode == "mean_std":
            offset, scale = np.asarray(entry["mean"], np.float64), np.asarray(entry["std"], np.float64)
        else:
            low, high = np.asarray(entry["q01"], np.float64), np.asarray(entry["q99"], np.float64)
            offset, scale = (low + high) / 2, (high - low) / 2
        return cls(key, mode, tuple(offset.ravel().tolist()), tuple(scale.ravel().tolist()))

    @classmethod
    def from_dataset(cls, root: str | os.PathLike, key: str, mode: str) -> StateNormalizer:
        if mode == "none":
            return cls(key, mode)
        path = Path(root) / "meta" / "stats.json"
        if _is_v21(Path(root)):
            from embodyhpc.data.v21_meta import v21_stats

            return cls.from_stats(v21_stats(root), key, mode)
        if not path.is_file():
            raise UserError(f"normalisation {mode!r} needs dataset statistics and {path} does not exist",
                            key="model.state_norm", fix="set model.state_norm=none, or use a LeRobot dataset "
                            "with meta/stats.json")
        return cls.from_stats(json.loads(path.read_text()), key, mode)

    def __call__(self, state: Any) -> Any:
        """Normalise a numpy array or torch tensor whose last axis is the state."""
        if self.mode == "none":
            return state
        if state.shape[-1] != len(self.offset):
            raise ValueError(f"{self.key} has {state.shape[-1]} dims, the statistics {len(self.offset)}")
        offset = np.asarray(self.offset, np.float32)
        scale = np.asarray(self.scale, np.float32)
        safe = np.where(scale > _EPS, scale, 1.0).astype(np.float32)
        keep = (scale > _EPS).astype(np.float32)
        if not isinstance(state, np.ndarray):  # a torch tensor: stay in torch
            import torch

            offset, safe, keep = (torch.as_tensor(a, device=state.device) for a in (offset, safe, keep))
            out = (state.float() - offset) / safe * keep
            return out.clamp(-1.0, 1.0) if self.mode == "quantile" else out
        out = (state.astype(np.float32) - offset) / safe * keep
        return np.clip(out, -1.0, 1.0) if self.mode == "quantile" else out

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "mode": self.mode, "offset": list(self.offset), "scale": list(self.scale)}

    def save(self, folder: str | os.PathLike) -> Path:
        path = Path(folder) / NORM_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, folder: str | os.PathLike) -> StateNormalizer | None:
        """The normaliser saved in an export folder; None when the folder has none (trained without). A file that
        is there but unreadable, of the wrong shape or holding a NaN, an infinity or a negative scale is a
        UserError naming the file and the field: a policy fed such states acts on garbage (NaN actions)."""
        path = Path(folder) / NORM_FILE
        if not os.path.lexists(path):
            return None
        fix = "export the checkpoint again (it copies the statistics training used), or repair the file"
        try:
            data = json.loads(path.read_text())  # NaN and Infinity parse: the check below names the field
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise UserError(f"unreadable ({type(exc).__name__}: {str(exc)[:120]})", where=str(path), fix=fix) from None
        if not isinstance(data, dict):
            raise UserError("not a JSON object", where=str(path), fix=fix)
        missing = [k for k in ("key", "mode", "offset", "scale") if k not in data]
        if missing:
            raise UserError(f"no {missing[0]!r} entry", where=str(path), key=missing[0], fix=fix)
        if not isinstance(data["key"], str) or not data["key"]:
            raise UserError(f"not a feature name ({data['key']!r})", where=str(path), key="key", fix=fix)
        if data["mode"] not in NORM_MODES:
            raise UserError(f"{data['mode']!r} is not one of {', '.join(NORM_MODES)}", where=str(path), key="mode",
                            fix=fix)
        offset, scale = (_finite_vector(data[k], path, k, fix) for k in ("offset", "scale"))
        if len(offset) != len(scale):
            raise UserError(f"{len(offset)} values, scale has {len(scale)}", where=str(path), key="offset", fix=fix)
        if data["mode"] != "none" and not offset:
            raise UserError(f"mode {data['mode']} with no statistics", where=str(path), key="offset", fix=fix)
        negative = next((i for i, v in enumerate(scale) if v < 0), None)
        if negative is not None:
            raise UserError(f"{scale[negative]} is negative", where=str(path), key=f"scale[{negative}]", fix=fix)
        return cls(data["key"], data["mode"], offset, scale)


def _finite_vector(values: Any, path: Path, key: str, fix: str) -> tuple[float, ...]:
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                               for v in values):
        raise UserError(f"not a list of numbers ({str(values)[:60]})", where=str(path), key=key, fix=fix)
    bad = next((i for i, v in enumerate(values) if not math.isfinite(v)), None)
    if bad is not None:
        raise UserError(f"{values[bad]} is not finite", where=str(path), key=f"{key}[{bad}]", fix=fix)
    return tuple(float(v) for v in values)


def _is_v21(root: Path) -> bool:
    from embodyhpc.data.v21_meta import CODEBASE_VERSION

    try:
        return json.loads((root / "meta" / "info.json").read_text()).get("codebase_version") == CODEBASE_VERSION
    except (OSError, ValueError, AttributeError):
        return False
