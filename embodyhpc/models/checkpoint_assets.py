"""What a checkpoint carries besides its weights: the state statistics and the prompt tokenizer a run should use.

    normalizer, source = resolve_normalizer(model_cfg, data_root, run_checkpoints=run / "checkpoints")
    tokenizer_path, source = resolve_tokenizer(model_cfg, run_checkpoints=run / "checkpoints")

Statistics, by `model.norm_stats` (the recipe key) and in this order:
1. the run's own `checkpoints/normalization.json`, written when the run started: a resumed run (or a requeued
   attempt) keeps the statistics it started with, whatever the dataset or the init checkpoint hold now;
2. `dataset`: the dataset's meta/stats.json;
3. a path: that file (any layout below), or a checkpoint folder holding one;
4. `init`: the checkpoint `model.init_weights` names must carry statistics; `auto` (the default): its statistics
   when it carries them, else the dataset's.

Layouts read (learned from the public code of each project; written here from scratch):
- embodyhpc: `normalization.json` beside exported weights ({"key", "mode", "offset", "scale"}).
- LeRobot's policy folder: `policy_preprocessor.json` lists the processor steps; the `normalizer_processor` step
  names its `state_file` (policy_preprocessor_step_<i>_normalizer_processor.safetensors: flat tensors
  "<feature>.<stat>", stat one of mean, std, min, max, q01, q99, ...) and its `norm_map` says how each feature type
  was normalised (pi0.5: STATE -> QUANTILES). A state file given alone is read for the recipe's mode.
- openpi: `assets/<asset_id>/norm_stats.json` ({"norm_stats": {"state": {"mean", "std", "q01", "q99"}, "actions":
  ...}}); a checkpoint with several asset ids must be told which one (model.norm_stats=PATH).
Only the state is normalised today (action normalisation is not built), so only the state's entry is read.

Every statistics file is checked before training starts (and at validate when the file is local): the entry for
the state key exists, holds the statistics the recipe's mode needs (quantile: q01/q99, mean_std: mean/std), as many
values as the dataset's state has, all finite, std >= 0 and q99 >= q01, and the mode a checkpoint was trained
with equals the recipe's. Anything else is one line naming the file, the key and the fix (exit 2).

Tokenizer: `model.tokenizer_path` wins; else, for a run that started before, what it started with (its copy in
checkpoints/, or the built-in one: init_weights applies to step 0 only); else a tokenizer
the init checkpoint carries: LeRobot's `tokenizer/` folder (what its TokenizerProcessorStep saves, named by the
step's `tokenizer_name`), or a `tokenizer.model` (SentencePiece) / `tokenizer.json` (tokenizers) in the folder
(what an embodyhpc export holds). openpi checkpoints carry none (openpi downloads PaliGemma's separately), nor do
LeRobot folders saved before the tokenizer was written as an artifact (their step names a hub id).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from embodyhpc.data.normalize import NORM_FILE, StateNormalizer
from embodyhpc.errors import ConfigError
from embodyhpc.models.stats_files import KEY, LEROBOT_PREPROCESSOR, from_saved, read_stats_file

NORM_STATS_SETTINGS = ("auto", "init", "dataset")
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")  # SentencePiece first: the format PaliGemma ships
LEROBOT_TOKENIZER_STEP = "tokenizer_processor"
OPENPI_STATS = "norm_stats.json"
OPENPI_ASSETS = "assets"



def checkpoint_folder(init_weights: str | os.PathLike) -> Path:
    """The folder of a checkpoint named by a file (model.safetensors, an index) or by the folder itself."""
    path = Path(init_weights).expanduser()
    return path if path.is_dir() else path.parent


# ---- statistics: where they are ----
def find_checkpoint_stats(folder: str | os.PathLike) -> Path | None:
    """The statistics file a checkpoint folder carries (see the module doc), None when it has none."""
    folder = Path(folder)
    for candidate in (folder / NORM_FILE, folder / LEROBOT_PREPROCESSOR, folder / OPENPI_STATS):
        if candidate.is_file():
            return candidate
    assets = folder / OPENPI_ASSETS
    # asset ids are names ("droid") or dataset repo ids ("physical-intelligence/libero"): one or two levels
    found = sorted([*assets.glob(f"*/{OPENPI_STATS}"), *assets.glob(f"*/*/{OPENPI_STATS}")]) if assets.is_dir() else []
    if len(found) > 1:
        ids = ", ".join(str(p.parent.relative_to(folder / OPENPI_ASSETS)) for p in found)
        raise ConfigError(f"{folder / OPENPI_ASSETS} holds statistics of {len(found)} asset ids ({ids}): which "
                          "robot's is this run's?", key=KEY,
                          fix=f"set {KEY}={found[0]} (the one of your robot) or {KEY}=dataset")
    return found[0] if found else None


def stats_file(setting: str, init_weights: str | None) -> Path | None:
    """The file `model.norm_stats` points training at (None: the dataset's statistics). Raises for `init`
    without statistics in the init checkpoint, and for a path that holds none."""
    if setting == "dataset":
        return None
    if setting in ("auto", "init"):
        if not init_weights:
            if setting == "init":
                raise ConfigError("norm_stats=init needs model.init_weights", key=KEY,
                                  fix=f"set model.init_weights, or {KEY}=dataset")
            return None
        found = find_checkpoint_stats(checkpoint_folder(init_weights))
        if found is None and setting == "init":
            raise ConfigError(f"the checkpoint {init_weights} carries no normalisation statistics (none of "
                              f"{NORM_FILE}, {LEROBOT_PREPROCESSOR}, {OPENPI_ASSETS}/*/{OPENPI_STATS})", key=KEY,
                              fix=f"set {KEY}=dataset, or {KEY}=/path/to/the/stats/file")
        return found
    path = Path(setting).expanduser()
    if path.is_dir():
        found = find_checkpoint_stats(path)
        if found is None:
            raise ConfigError(f"{path} holds no normalisation statistics", key=KEY,
                              fix=f"name the file ({NORM_FILE}, {OPENPI_STATS}, a LeRobot normalizer "
                                  ".safetensors) or set model.norm_stats=dataset")
        return found
    if not path.is_file():
        raise ConfigError(f"no statistics file at {path}", key=KEY,
                          fix="give an existing file, or auto / init / dataset")
    return path


def dataset_state_dim(data_root: str | os.PathLike | None, key: str) -> int | None:
    """The state's size from a LeRobot dataset's meta/info.json (None where it cannot be read: not checked)."""
    if not data_root:
        return None
    info = Path(data_root) / "meta" / "info.json"
    try:
        shape = json.loads(info.read_text())["features"][key]["shape"]
        return int(shape[-1])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


# ---- statistics: what training uses ----
def resolve_normalizer(model_cfg: Any, data_root: str | os.PathLike | None, *,
                       run_checkpoints: str | os.PathLike | None = None) -> tuple[StateNormalizer, str]:
    """(normaliser, where it came from) for a training run (see the module doc for the order)."""
    key, mode = model_cfg.state_key, model_cfg.state_norm
    if mode == "none":
        return StateNormalizer(key, mode), "none"
    state_dim = dataset_state_dim(data_root, key)
    if run_checkpoints is not None and (Path(run_checkpoints) / NORM_FILE).is_file():
        own = Path(run_checkpoints) / NORM_FILE
        return read_stats_file(own, key=key, mode=mode, state_dim=state_dim), f"{own} (the run's own, kept on resume)"
    path = stats_file(model_cfg.norm_stats, model_cfg.init_weights)
    if path is None:
        normalizer = StateNormalizer.from_dataset(data_root, key, mode)  # type: ignore[arg-type]
        checked = from_saved(normalizer.to_dict(), where=f"{data_root}/meta/stats.json", key=key, mode=mode,
                             state_dim=state_dim)
        return checked, f"{data_root}/meta/stats.json"
    return read_stats_file(path, key=key, mode=mode, state_dim=state_dim), str(path)


def check_norm_stats(model_cfg: Any, data_root: str | None) -> list[str]:
    """Validate time, on the submitting machine: the statistics file the recipe will use fits (raises ConfigError);
    returns warnings (statistics that fit but do not describe the dataset: `fit_warning`). Files this machine cannot
    see are left to the job."""
    if model_cfg.state_norm == "none":
        return []
    setting = model_cfg.norm_stats
    init = model_cfg.init_weights
    if setting in ("auto", "init") and init and not Path(init).expanduser().exists():
        return []
    if setting not in NORM_STATS_SETTINGS and not Path(setting).expanduser().exists():
        return []  # validation/paths.py reports a missing path (or warns for an unmounted filesystem)
    path = stats_file(setting, model_cfg.init_weights)
    if path is None:
        return []
    normalizer = read_stats_file(path, key=model_cfg.state_key, mode=model_cfg.state_norm,
                                 state_dim=dataset_state_dim(data_root, model_cfg.state_key))
    warning = fit_warning(normalizer, data_root, str(path))
    return [warning] if warning else []


FIT_LIMIT = {"quantile": 1.0, "mean_std": 3.0}
"""How far (in normalised units) the dataset's mean may land from 0 before statistics are said not to describe it:
outside [-1, 1] under quantile statistics is beyond their 1st/99th percentile, beyond 3 std under mean_std."""


def fit_warning(normalizer: StateNormalizer, data_root: str | os.PathLike | None, source: str) -> str | None:
    """A warning when statistics that fit the dataset's shape do not describe its values (e.g. another robot's,
    of the same state size: DROID's 8-d state and LIBERO's): the dataset's mean, normalised, lies beyond FIT_LIMIT
    in some dimension. None when they describe it, or the dataset has no statistics to compare with."""
    if normalizer.mode not in FIT_LIMIT or not data_root:
        return None
    try:
        mean = json.loads((Path(data_root) / "meta" / "stats.json").read_text())[normalizer.key]["mean"]
        mean = [float(v) for v in mean]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if len(mean) != len(normalizer.offset):
        return None
    far = [(i, (m - o) / s) for i, (m, o, s) in enumerate(zip(mean, normalizer.offset, normalizer.scale, strict=True))
           if s > 0 and abs((m - o) / s) > FIT_LIMIT[normalizer.mode]]
    if not far:
        return None
    dims = ", ".join(f"{normalizer.key}[{i}] at {z:+.1f}" for i, z in far[:4])
    return (f"model.norm_stats: the statistics of {source} do not describe {data_root}: its mean normalises to "
            f"{dims} (beyond {FIT_LIMIT[normalizer.mode]:g}); if the checkpoint was trained on another robot, set "
            "model.norm_stats=dataset")


# ---- tokenizer ----
def find_checkpoint_tokenizer(folder: str | os.PathLike) -> Path | None:
    """The tokenizer file a checkpoint folder carries (module doc), None when it has none."""
    folder = Path(folder)
    candidates = [folder / name for name in TOKENIZER_FILES]
    pipeline = folder / LEROBOT_PREPROCESSOR
    if pipeline.is_file():
        try:
            steps = json.loads(pipeline.read_text()).get("steps") or []
        except (OSError, ValueError, AttributeError):
            steps = []
        for step in steps:
            if isinstance(step, dict) and step.get("registry_name") == LEROBOT_TOKENIZER_STEP:
                config = step.get("config") if isinstance(step.get("config"), dict) else {}
                name = config.get("tokenizer_name")
                local = _inside(folder, name) if isinstance(name, str) else None
                if local is not None and local.is_dir():
                    candidates = [local / n for n in TOKENIZER_FILES] + candidates
                elif local is not None and local.is_file():
                    candidates.insert(0, local)
    candidates += [folder / "tokenizer" / n for n in TOKENIZER_FILES]
    return next((c for c in candidates if c.is_file()), None)


def _inside(folder: Path, relative: str) -> Path | None:
    """folder/relative when it stays inside folder (a hub id or an escaping path: None)."""
    path = Path(relative)
    if path.is_absolute() or ".." in path.parts:
        return None
    candidate = folder / path
    try:
        candidate.resolve().relative_to(folder.resolve())
    except ValueError:
        return None
    return candidate


def resolve_tokenizer(model_cfg: Any, *, run_checkpoints: str | os.PathLike | None = None) -> tuple[str | None, str]:
    """(tokenizer file or None for the built-in one, where it came from): model.tokenizer_path, else the run's own
    copy (resume), else the init checkpoint's."""
    if model_cfg.tokenizer_path:
        return model_cfg.tokenizer_path, "model.tokenizer_path"
    if run_checkpoints is not None and (Path(run_checkpoints) / NORM_FILE).is_file():
        # the run started before (it writes its statistics first): init_weights applies to step 0 only, so the
        # tokenizer is the copy it left, or the built-in one it started with
        own = export_tokenizer(run_checkpoints)
        if own is not None:
            return str(own), f"{own} (the run's own, kept on resume)"
        return None, "built-in (as the run started)"
    if model_cfg.init_weights:
        found = find_checkpoint_tokenizer(checkpoint_folder(model_cfg.init_weights))
        if found is not None:
            return str(found), f"{found} (model.init_weights)"
    return None, "built-in"


def tokenizer_copy_name(path: str | os.PathLike) -> str:
    """The name a tokenizer file keeps beside a run's checkpoints and exports (by its format)."""
    return TOKENIZER_FILES[0] if Path(path).suffix == ".model" else TOKENIZER_FILES[1]


def saved_normalizer(folder: str | os.PathLike) -> StateNormalizer | None:
    """The statistics saved beside exported weights (normalization.json), None when there are none."""
    return StateNormalizer.load(folder)


def export_tokenizer(folder: str | os.PathLike) -> Path | None:
    """The tokenizer copy in an export or checkpoints folder (what training used), None when it used the built-in."""
    return next((Path(folder) / n for n in TOKENIZER_FILES if (Path(folder) / n).is_file()), None)


__all__ = ["KEY", "NORM_STATS_SETTINGS", "TOKENIZER_FILES", "check_norm_stats", "checkpoint_folder",
           "dataset_state_dim", "export_tokenizer", "fit_warning", "find_checkpoint_stats", "find_checkpoint_tokenizer",
           "read_stats_file", "resolve_normalizer", "resolve_tokenizer", "saved_normalizer", "stats_file",
           "tokenizer_copy_name"]
