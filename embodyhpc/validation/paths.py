"""Paths a job will read, checked on the machine that submits: at validate, render and submit, not after hours.

A path on a filesystem this machine sees (its first folder exists here: /tmp, /home, /lustre on a login node
that mounts it) must exist: missing is an error. A path on a filesystem this machine does not mount (a login
node without /lustre, a laptop rendering for a cluster) cannot be checked: a warning names it and the job checks it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from embodyhpc.config import file_formats
from embodyhpc.config.load import LoadedRecipe
from embodyhpc.errors import ConfigError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def visible_here(path: Path) -> bool:
    """Whether the filesystem holding `path` is mounted on this machine (its first folder exists)."""
    parts = path.parts
    return len(parts) < 2 or Path(parts[0], parts[1]).exists()


def check_paths(loaded: LoadedRecipe, *, submitting: bool = False, training: bool = True) -> list[str]:
    """Errors (ConfigError, naming the key and the layer that set it) for what cannot work; warnings for what
    cannot be checked from here. `submitting`: a required value still unset is an error, not a warning.
    `training`: the chain trains (an evaluation of existing weights reads no dataset)."""
    cfg = loaded.config
    warnings: list[str] = []

    def where(key: str) -> str | None:
        while key:
            if key in loaded.provenance:
                return loaded.provenance[key]
            key = key.rpartition(".")[0]
        return None

    def check(key: str, value: str, what: str, form: Callable[[str, Path], None] | None = None) -> None:
        path = Path(value).expanduser()
        if _HUB_ID.match(value) and not path.exists():
            raise ConfigError(f"{value!r} looks like a Hugging Face hub id; jobs read a local {what}", key=key,
                              where=where(key), fix=f"download it to the shared filesystem and set {key}=/path/to/it")
        absolute = path if path.is_absolute() else Path.cwd() / path
        if absolute.exists():
            if form is not None:  # of the kind the job reads (file_formats: a few bytes, never a device)
                try:
                    form(key, absolute)
                except ConfigError as exc:
                    raise ConfigError(exc.message, key=key, where=where(key), fix=exc.fix) from None
            return
        if visible_here(absolute):
            raise ConfigError(f"{what} {value!r} does not exist", key=key, where=where(key),
                              fix=f"set {key} to an existing {what}")
        warnings.append(f"{key}={value}: not visible from this machine ({absolute.parts[1]!r} is not mounted "
                        "here); the job checks it on the cluster")

    if training and cfg.data.format != "synthetic" and cfg.data.root:
        check("data.root", cfg.data.root, "dataset")
    for i, entry in enumerate(cfg.data.datasets or () if training and cfg.data.format != "synthetic" else ()):
        check(f"data.datasets[{i}].root", entry.root, "dataset")
    if training and cfg.model.init_weights:
        check("model.init_weights", cfg.model.init_weights, "weights file or folder", file_formats.check_weights)
    if training and cfg.model.state_norm != "none" and cfg.data.format != "synthetic":
        from embodyhpc.models.checkpoint_assets import NORM_STATS_SETTINGS, check_norm_stats

        if cfg.model.norm_stats not in NORM_STATS_SETTINGS:
            check("model.norm_stats", cfg.model.norm_stats, "statistics file")
        warnings += check_norm_stats(cfg.model, cfg.data.root)  # the file training would read, if seen here
    replay = cfg.eval.suite_options.get("replay_dataset")
    if replay:
        check("eval.suite_options.replay_dataset", str(replay), "dataset")
    if cfg.model.tokenizer_path:
        check("model.tokenizer_path", cfg.model.tokenizer_path, "tokenizer file", file_formats.check_tokenizer)
    elif _carried_tokenizer(cfg, training):
        pass  # the checkpoint's (checked: it loads and fits the model), or the copy beside evaluated weights
    elif needed := _tokenizer_file(cfg.model):
        what, example = needed
        message = f"model.tokenizer_path is unset: {what}"
        fix = f"set model.tokenizer_path={example}"
        if submitting:
            raise ConfigError(message, key="model.tokenizer_path", where=where("model.size"), fix=fix)
        warnings.append(f"{message}; submit refuses until it is set ({fix})")
    if training:  # what a DataLoader worker would refuse hours later: the recipe against its dataset
        from embodyhpc.validation.data_checks import check_recipe_data

        root = Path(cfg.data.root).expanduser() if cfg.data.root else None
        warnings += check_recipe_data(cfg, where, dataset_visible=root is not None and root.exists())
        if cfg.data.datasets:  # a mixture: each dataset as data.root would be, then what must agree across them
            from embodyhpc.validation.mixture_checks import check_mixture

            warnings += check_mixture(cfg, where)
    from embodyhpc.config.limits import warnings as large_values

    return warnings + large_values(cfg)


def _carried_tokenizer(cfg, training: bool) -> bool:
    """Whether the weights the chain starts from carry the tokenizer it will read (models/checkpoint_assets.py):
    training, the one model.init_weights carries (loaded here, so a file that does not load or does not fit the
    model is refused now); evaluating existing weights, the copy training left beside them."""
    import dataclasses

    weights = cfg.model.init_weights if training else cfg.eval.weights
    if not weights or not Path(weights).expanduser().exists():
        return False  # before the imports below: validate stays free of numpy and torch for most recipes
    from embodyhpc.models import build_tokenizer
    from embodyhpc.models.checkpoint_assets import checkpoint_folder, export_tokenizer, find_checkpoint_tokenizer

    if training:
        found = find_checkpoint_tokenizer(checkpoint_folder(cfg.model.init_weights))
        if found is not None:
            build_tokenizer(dataclasses.replace(cfg.model, tokenizer_path=str(found)))
        return found is not None
    folder = Path(cfg.eval.weights).expanduser()
    return any(export_tokenizer(f) is not None for f in (folder, folder.parent))


def _tokenizer_file(model_cfg) -> tuple[str, str] | None:
    """(what the model needs, an example path) when its size reads a tokenizer file (the spec's tokenizer_file)."""
    from embodyhpc.models.spec import model_spec

    return dict(model_spec(model_cfg.name).tokenizer_file).get(model_cfg.size)
