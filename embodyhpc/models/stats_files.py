"""Statistics files of each published layout, read and checked: what embodyhpc/models/checkpoint_assets.py hands
training (the module doc there says which layouts and which checks).

    normalizer = read_stats_file(path, key="observation.state", mode="quantile", state_dim=8)

Raises ConfigError (key model.norm_stats, the file as `where`, a fix) for anything that does not fit.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from embodyhpc.data.normalize import StateNormalizer
from embodyhpc.errors import ConfigError

KEY = "model.norm_stats"
LEROBOT_PREPROCESSOR = "policy_preprocessor.json"
LEROBOT_NORMALIZER_STEP = "normalizer_processor"
OPENPI_STATE_KEY = "state"
_LEROBOT_MODES = {"QUANTILES": "quantile", "MEAN_STD": "mean_std", "IDENTITY": "none", "MIN_MAX": "min_max",
                  "QUANTILE10": "quantile10"}
_NEEDS = {"quantile": ("q01", "q99"), "mean_std": ("mean", "std")}
_STEP_STATE_FILE = re.compile(r"^[\w.-]+\.safetensors$")


def read_stats_file(path: str | Path, *, key: str, mode: str, state_dim: int | None) -> StateNormalizer:
    """The state normaliser held by a statistics file of any layout above, checked (see the module doc)."""
    path = Path(path)
    where = str(path)
    if path.suffix == ".safetensors":
        return _from_stat_table(_read_safetensors(path), where=where, key=key, mode=mode, state_dim=state_dim,
                                trained_mode=_lerobot_mode_beside(path, key))
    data = _read_json(path)
    if isinstance(data, dict) and "steps" in data:
        return _from_lerobot_pipeline(path, data, key=key, mode=mode, state_dim=state_dim)
    if isinstance(data, dict) and "norm_stats" in data:
        table = data["norm_stats"]
        if not isinstance(table, dict):
            raise ConfigError("norm_stats is not a mapping", where=where, key=KEY, fix="give an openpi norm_stats.json")
        entry_key = key if key in table else OPENPI_STATE_KEY
        flat = {f"{entry_key}.{stat}": value for stat, value in (table.get(entry_key) or {}).items()
                if value is not None} if isinstance(table.get(entry_key), dict) else {}
        return _from_stat_table(flat, where=where, key=entry_key, mode=mode, state_dim=state_dim, ours_key=key,
                                listing=sorted(table))
    if isinstance(data, dict) and {"key", "mode", "offset", "scale"} <= set(data):
        return from_saved(data, where=where, key=key, mode=mode, state_dim=state_dim)
    raise ConfigError("not a statistics file embodyhpc reads (an embodyhpc normalization.json, an openpi "
                      "norm_stats.json or LeRobot's policy_preprocessor.json)", where=where, key=KEY,
                      fix=f"name one of those, or set {KEY}=dataset")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cannot read it as JSON ({type(exc).__name__}: {str(exc)[:120]})", where=str(path),
                          key=KEY, fix=f"repair or replace the file, or set {KEY}=dataset") from None


def _read_safetensors(path: Path) -> dict[str, Any]:
    try:
        from safetensors.numpy import load_file

        return {name: value.astype("float64").tolist() for name, value in load_file(str(path)).items()}
    except Exception as exc:  # safetensors' own error type for a damaged header
        raise ConfigError(f"not a readable safetensors file ({str(exc)[:120]})", where=str(path), key=KEY,
                          fix=f"replace the file, or set {KEY}=dataset") from None


def _lerobot_mode_beside(state_file: Path, key: str) -> str | None:
    """The mode a LeRobot normalizer state file was used with, from the policy_preprocessor.json beside it."""
    pipeline = state_file.parent / LEROBOT_PREPROCESSOR
    if not pipeline.is_file():
        return None
    data = _read_json(pipeline)
    step = _normalizer_step(data, pipeline) if isinstance(data, dict) else None
    return _lerobot_mode(step, key) if step is not None else None


def _normalizer_step(data: dict[str, Any], where: Path) -> dict[str, Any] | None:
    steps = data.get("steps")
    if not isinstance(steps, list):
        raise ConfigError("its 'steps' is not a list", where=str(where), key=KEY,
                          fix=f"give LeRobot's {LEROBOT_PREPROCESSOR}, or set {KEY}=dataset")
    return next((s for s in steps if isinstance(s, dict) and s.get("registry_name") == LEROBOT_NORMALIZER_STEP), None)


def _lerobot_mode(step: dict[str, Any], key: str) -> str | None:
    config = step.get("config") if isinstance(step.get("config"), dict) else {}
    features, norm_map = config.get("features") or {}, config.get("norm_map") or {}
    feature_type = (features.get(key) or {}).get("type", "STATE") if isinstance(features, dict) else "STATE"
    mode = norm_map.get(feature_type) if isinstance(norm_map, dict) else None
    return _LEROBOT_MODES.get(str(mode), str(mode).lower()) if mode is not None else None


def _from_lerobot_pipeline(path: Path, data: dict[str, Any], *, key: str, mode: str,
                           state_dim: int | None) -> StateNormalizer:
    step = _normalizer_step(data, path)
    if step is None:
        raise ConfigError(f"no {LEROBOT_NORMALIZER_STEP} step: the policy normalises nothing", where=str(path),
                          key=KEY, fix=f"set {KEY}=dataset (or model.state_norm=none)")
    name = step.get("state_file")
    if not isinstance(name, str) or not _STEP_STATE_FILE.match(name):  # a plain file name beside it, nothing else
        raise ConfigError(f"the {LEROBOT_NORMALIZER_STEP} step's state_file {name!r} is not a .safetensors file "
                          "name beside it", where=str(path), key=KEY, fix=f"repair the file or set {KEY}=dataset")
    state_file = path.parent / name
    if not state_file.is_file():
        raise ConfigError(f"its {LEROBOT_NORMALIZER_STEP} step names {name}, which is not there", where=str(path),
                          key=KEY, fix=f"copy the whole policy folder, or set {KEY}=dataset")
    return _from_stat_table(_read_safetensors(state_file), where=str(state_file), key=key, mode=mode,
                            state_dim=state_dim, trained_mode=_lerobot_mode(step, key))


def _from_stat_table(flat: dict[str, Any], *, where: str, key: str, mode: str, state_dim: int | None,
                     trained_mode: str | None = None, ours_key: str | None = None,
                     listing: list[str] | None = None) -> StateNormalizer:
    """flat: {"<feature>.<stat>": values} (LeRobot's state file; openpi's entries flattened the same way)."""
    ours_key = ours_key or key
    if trained_mode is not None and trained_mode != mode:
        raise ConfigError(f"the checkpoint normalised {key} with {trained_mode}, the recipe with {mode}", where=where,
                          key=KEY, related=("model.state_norm",),
                          fix=f"set model.state_norm={trained_mode} (as the checkpoint was trained) or {KEY}=dataset")
    stats: dict[str, Any] = {}
    for name, values in flat.items():
        feature, _, stat = name.rpartition(".")
        if feature == key:
            stats[stat] = values
    if not stats:
        features = sorted(listing or {n.rpartition(".")[0] for n in flat})
        raise ConfigError(f"no statistics for {key!r} (entries: {', '.join(features) or 'none'})", where=where,
                          key=KEY, related=("model.state_key",),
                          fix=f"set model.state_key to the state feature the checkpoint was trained on, or "
                              f"{KEY}=dataset")
    needed = _NEEDS[mode]
    missing = [s for s in needed if s not in stats]
    if missing:
        other = "mean_std" if mode == "quantile" else "quantile"
        has_other = all(s in stats for s in _NEEDS[other])
        raise ConfigError(f"{key!r} has no {'/'.join(missing)} (it holds {', '.join(sorted(stats))}): model.state_norm="
                          f"{mode} needs {' and '.join(needed)}", where=where, key=KEY,
                          related=("model.state_norm",),
                          fix=(f"set model.state_norm={other}, which these statistics serve, or {KEY}=dataset"
                               if has_other else f"set {KEY}=dataset"))
    arrays = {s: _vector(stats[s], where=where, name=f"{key}.{s}") for s in needed}
    lengths = {len(v) for v in arrays.values()}
    if len(lengths) != 1:
        raise ConfigError(f"{key}: {', '.join(f'{s} has {len(v)} values' for s, v in arrays.items())}", where=where,
                          key=KEY, fix=f"repair the file, or set {KEY}=dataset")
    _check_dim(lengths.pop(), state_dim, where=where, name=key)
    if mode == "mean_std":
        low = [i for i, v in enumerate(arrays["std"]) if v < 0]
        if low:
            raise ConfigError(f"{key}.std[{low[0]}] = {arrays['std'][low[0]]} is negative", where=where, key=KEY,
                              fix=f"repair the statistics, or set {KEY}=dataset")
        offset, scale = arrays["mean"], arrays["std"]
    else:
        bad = [i for i, (lo, hi) in enumerate(zip(arrays["q01"], arrays["q99"], strict=True)) if hi < lo]
        if bad:
            raise ConfigError(f"{key}.q99[{bad[0]}] < q01[{bad[0]}] ({arrays['q99'][bad[0]]} < "
                              f"{arrays['q01'][bad[0]]})", where=where, key=KEY,
                              fix=f"repair the statistics, or set {KEY}=dataset")
        offset = [(lo + hi) / 2 for lo, hi in zip(arrays["q01"], arrays["q99"], strict=True)]
        scale = [(hi - lo) / 2 for lo, hi in zip(arrays["q01"], arrays["q99"], strict=True)]
    return StateNormalizer(ours_key, mode, tuple(offset), tuple(scale))


def from_saved(data: dict[str, Any], *, where: str, key: str, mode: str, state_dim: int | None) -> StateNormalizer:
    """Our own layout ({"key", "mode", "offset", "scale"}: normalization.json, or StateNormalizer.to_dict()),
    checked."""
    if data["key"] != key:
        raise ConfigError(f"statistics of {data['key']!r}, the recipe's state is {key!r}", where=where, key=KEY,
                          related=("model.state_key",),
                          fix=f"set model.state_key={data['key']} (as the checkpoint was trained) or {KEY}=dataset")
    if data["mode"] != mode:
        raise ConfigError(f"the checkpoint normalised {key} with {data['mode']}, the recipe with {mode}", where=where,
                          key=KEY, related=("model.state_norm",),
                          fix=f"set model.state_norm={data['mode']} (as the checkpoint was trained) or {KEY}=dataset")
    if mode == "none":
        return StateNormalizer(key, mode)
    offset = _vector(data["offset"], where=where, name=f"{key}.offset")
    scale = _vector(data["scale"], where=where, name=f"{key}.scale")
    if len(offset) != len(scale):
        raise ConfigError(f"{key}: offset has {len(offset)} values, scale {len(scale)}", where=where, key=KEY,
                          fix=f"repair the file, or set {KEY}=dataset")
    _check_dim(len(offset), state_dim, where=where, name=key)
    negative = [i for i, v in enumerate(scale) if v < 0]
    if negative:
        raise ConfigError(f"{key}.scale[{negative[0]}] = {scale[negative[0]]} is negative", where=where, key=KEY,
                          fix=f"repair the statistics, or set {KEY}=dataset")
    return StateNormalizer(key, mode, tuple(offset), tuple(scale))


def _vector(values: Any, *, where: str, name: str) -> list[float]:
    flat = values
    while isinstance(flat, list) and len(flat) == 1 and isinstance(flat[0], list):  # [[...]] as some writers nest
        flat = flat[0]
    if not isinstance(flat, list) or not flat or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
        raise ConfigError(f"{name} is not a list of numbers ({str(values)[:60]})", where=where, key=KEY,
                          fix=f"repair the statistics, or set {KEY}=dataset")
    bad = next((i for i, v in enumerate(flat) if not math.isfinite(v)), None)
    if bad is not None:
        raise ConfigError(f"{name}[{bad}] is {flat[bad]}", where=where, key=KEY,
                          fix=f"recompute the statistics (a NaN or infinite value), or set {KEY}=dataset")
    return [float(v) for v in flat]


def _check_dim(length: int, state_dim: int | None, *, where: str, name: str) -> None:
    if state_dim is not None and length != state_dim:
        raise ConfigError(f"statistics of {name} have {length} values, the dataset's state has {state_dim}",
                          where=where, key=KEY, related=("model.state_key",),
                          fix=f"use statistics of this robot's state, or set {KEY}=dataset")


__all__ = ["KEY", "LEROBOT_NORMALIZER_STEP", "LEROBOT_PREPROCESSOR", "from_saved", "read_stats_file"]
