"""Consolidated weights for evaluation and for users: one safetensors file + the resolved config.

The weights are read back from a complete DCP folder by one process, not gathered from the live model: DCP puts
every shard of every saving rank into a plain full-size tensor, without collectives, so the export can run on
rank 0 alone, after the job (`embodyhpc export`), or inside an evaluation job. Only the model's entries are read;
the optimizer (2x the weights for AdamW) stays on disk. Peak memory: the full model, once, on the CPU.

Which weights (`weights_kind`, the recipe's eval.weights_kind; `choose_weights`): a checkpoint of a run with
train.ema_decay holds, beside the parameters (`model.<name>`), their moving average (`ema.<name>`, fp32). The export
holds the average (ema: every averaged parameter is read from `ema.<name>` instead, cast to the parameter's saved
dtype; buffers and frozen parameters from `model.`) or the optimizer's weights (raw); unset, the average when there
is one. export.json says which (`weights_kind`), and an export of the average is built from something else than one
of the raw weights (`built_from`), so neither is ever reused in the other's place.

    <out_dir>/
        model.safetensors   the model's state_dict (parameter names of the plain, unwrapped module)
        config.yaml         the resolved recipe the weights were trained with, as given
                            (a module's _extra_state, such as transformer-engine's FP8 scaling state, is training
                            state, not weights: it stays in the checkpoint)
        export.json         step, source folder, counts, size and sha256 of the weights, what they were built
                            from, sha256 of each side file (embodyhpc.checkpoint.integrity): written last, so its
                            presence means the export is whole; `load_exported` checks the weights and side files
                            against it before anything uses them
        <side files>        what the writer passes as `side_files` (the run's normalization.json, policy_io.json,
                            tokenizer copy), copied in before export.json is written
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from embodyhpc.atomic import replace_atomically, write_json_atomic
from embodyhpc.checkpoint import layout
from embodyhpc.checkpoint.errors import NotACheckpointError, last_line
from embodyhpc.checkpoint.integrity import (
    CONFIG_FILE,
    DCP_METADATA,
    EXPORT_JSON,
    REEXPORT,
    SIDE_FILES_KEY,
    WEIGHTS_FILE,
    WEIGHTS_KIND_KEY,
    check_side_name,
    checkpoint_id,
    safetensors_header,
    sha256_file,
    sha256_text,
    side_file_hashes,
    verify_export,
)
from embodyhpc.checkpoint.state import EMA_KEY, MODEL_KEY, is_module_extra_state

__all__ = ["CONFIG_FILE", "EXPORT_JSON", "WEIGHTS_FILE", "WEIGHTS_KIND_KEY", "built_from", "choose_weights",
           "consolidated_model_state", "export_consolidated", "has_average", "load_exported", "model_entries"]

_DAMAGED = "the checkpoint is damaged: evaluate another step-N folder"
_NO_AVERAGE_FIX = "evaluate its raw weights: eval.weights_kind=raw (or unset, which takes what the checkpoint has)"


def choose_weights(requested: str | None, has_ema: bool, *, where: str) -> str:
    """The weights an export of a checkpoint holds: `requested` (eval.weights_kind: "ema" or "raw"), or when None
    "ema" if the checkpoint holds a moving average (`has_ema`), else "raw". "ema" for a checkpoint without one is
    refused in one line (NotACheckpointError naming `where`)."""
    if requested not in (None, "ema", "raw"):
        raise ValueError(f"weights_kind must be ema, raw or None, got {requested!r}")
    if requested is None:
        return "ema" if has_ema else "raw"
    if requested == "ema" and not has_ema:
        raise NotACheckpointError("holds no moving average of the weights (eval.weights_kind=ema; the run trained "
                                  "with train.ema_decay: null)", where=where, fix=_NO_AVERAGE_FIX)
    return requested


def has_average(folder: str | Path) -> bool:
    """Whether a complete checkpoint folder holds a moving average of the weights (its metadata's EMA entries)."""
    return bool(_entries(Path(folder), EMA_KEY, required=False)[1])


def consolidated_model_state(folder: str | Path, weights_kind: str = "raw") -> dict[str, torch.Tensor]:
    """The full model state dict of a complete checkpoint folder, in the dtypes it was saved in; with
    weights_kind="ema" every parameter the checkpoint averaged holds its average instead (cast to the parameter's
    saved dtype), and a checkpoint without an average is refused."""
    folder = Path(folder)
    reader, entries = _model_entries(folder)
    average: dict[str, tuple[torch.dtype, torch.Size]] = {}
    if weights_kind == "ema":
        average = _entries(folder, EMA_KEY, required=False)[1]
        choose_weights("ema", bool(average), where=str(folder))
        odd = sorted(name for name in average if name not in entries or entries[name][1] != average[name][1])
        if odd:
            raise NotACheckpointError(f"its moving average of {odd[0]!r} matches no model tensor of that shape",
                                      where=str(folder), fix=_DAMAGED)
    elif weights_kind != "raw":
        raise ValueError(f"weights_kind must be ema or raw, got {weights_kind!r}")
    # Keys are DCP's flattened names ("model.<fqn>", "ema.<fqn>"), which match the flat dict as given: each name is
    # read once, from the average where there is one. no_dist: one process reads every shard, no collectives (DCP
    # warns about exactly that when no process group is up).
    state = {f"{EMA_KEY}.{key}" if key in average else f"{MODEL_KEY}.{key}":
             torch.empty(size, dtype=average[key][0] if key in average else dtype)
             for key, (dtype, size) in entries.items()}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as exc:  # a BaseException wrapping each rank's failure, many lines
        raise NotACheckpointError(f"its shards cannot be read ({last_line(exc)})", where=str(folder),
                                  fix="the checkpoint is damaged: evaluate another step-N folder") from None
    weights = {key.partition(".")[2]: tensor for key, tensor in state.items()}
    return {key: tensor.to(entries[key][0]) for key, tensor in weights.items()}


def model_entries(folder: str | Path) -> dict[str, tuple[torch.dtype, torch.Size]]:
    """{name: (dtype, shape)} of the model in a complete checkpoint folder, from its metadata alone; refuses a
    folder whose metadata is missing or unreadable or whose shard files are missing or shorter than it says."""
    return _model_entries(Path(folder))[1]


def _model_entries(folder: Path) -> tuple[FileSystemReader, dict[str, tuple[torch.dtype, torch.Size]]]:
    return _entries(folder, MODEL_KEY, required=True)


def _entries(folder: Path, top: str, *, required: bool) -> tuple[FileSystemReader,
                                                                 dict[str, tuple[torch.dtype, torch.Size]]]:
    """{name: (dtype, shape)} of the `top` entries (MODEL_KEY, EMA_KEY) of a complete checkpoint folder, their shard
    files checked; none found is refused when `required`."""
    if not layout.is_complete(folder):
        raise NotACheckpointError(f"no {layout.MARKER} marker: not a complete checkpoint", where=str(folder),
                                  fix="pass a step-N folder that has the marker (checkpoints/latest names one)")
    if not (folder / DCP_METADATA).is_file():
        raise NotACheckpointError(f"no {DCP_METADATA} file: not a DCP checkpoint, or a damaged one",
                                  where=str(folder), fix="evaluate another step-N folder")
    reader = FileSystemReader(folder)
    try:
        metadata = reader.read_metadata()
        items = metadata.state_dict_metadata.items()
    except Exception as exc:  # a truncated or garbage pickle: any of a dozen exception types
        raise NotACheckpointError(f"unreadable {DCP_METADATA} ({type(exc).__name__})", where=str(folder),
                                  fix="the checkpoint is damaged: evaluate another step-N folder") from None
    prefix = top + "."
    entries: dict[str, tuple[torch.dtype, torch.Size]] = {}
    for key, meta in items:
        if not key.startswith(prefix) or is_module_extra_state(key):
            continue  # optimizer state; a module's _extra_state (transformer-engine's FP8 scaling state): no weights
        if not isinstance(meta, TensorStorageMetadata):  # e.g. a module's _extra_state: no place in safetensors
            raise NotACheckpointError(f"model entry {key!r} is not a tensor; safetensors holds tensors only",
                                      where=str(folder))
        entries[key[len(prefix):]] = (meta.properties.dtype, meta.size)
    if not entries and required:
        raise NotACheckpointError(f"no {top!r} entries in the checkpoint", where=str(folder))
    sizes: dict[str, int | None] = {}
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        if not getattr(index, "fqn", "").startswith(prefix) or is_module_extra_state(index.fqn):
            continue
        name = info.relative_path
        if name not in sizes:
            try:
                sizes[name] = (folder / name).stat().st_size
            except OSError:
                sizes[name] = None
        if sizes[name] is None or sizes[name] < info.offset + info.length:
            what = "missing" if sizes[name] is None else f"truncated ({sizes[name]} bytes, needs "
            what += "" if sizes[name] is None else f"{info.offset + info.length})"
            raise NotACheckpointError(f"shard file {name} is {what}", where=str(folder),
                                      fix="the checkpoint is damaged: evaluate another step-N folder")
    return reader, entries


def built_from(folder: str | Path, config_yaml: str, weights_kind: str = "raw") -> dict[str, str]:
    """The key of an export: the checkpoint folder, what is in it, the recipe it is exported with, and for an export
    of the moving average that it is one (an export of the raw weights has the key exports had before averages)."""
    key = {"checkpoint": str(Path(folder).resolve()), "checkpoint_id": checkpoint_id(folder),
           "config_sha256": sha256_text(merged_lora_config(config_yaml)[0])}
    if weights_kind != "raw":
        key[WEIGHTS_KIND_KEY] = weights_kind
    return key


def export_consolidated(folder: str | Path, out_dir: str | Path, *, config_yaml: str,
                        dtype: torch.dtype | None = None, side_files: Mapping[str, str | Path | None] | None = None,
                        weights_kind: str | None = None) -> Path:
    """Write <out_dir>/model.safetensors, config.yaml and export.json from a complete checkpoint folder.

    `weights_kind`: "ema", "raw", or None for the average when the checkpoint has one (choose_weights; the module
    docstring); export.json's `weights_kind` records the choice.

    `dtype` casts floating-point tensors (e.g. torch.bfloat16 to halve the file); None keeps the saved dtypes.
    `side_files`: {file name: the file to copy in as that name, or None for one the export does not have (a copy
    left in out_dir by an earlier export is removed)}; their hashes go into export.json (integrity.verify_export
    checks them). None records no side files (an export that is only weights and config). Returns the weights path.
    """
    from safetensors.torch import save_file  # the `train` extra; imported here so the package imports without it

    folder, out_dir = Path(folder), Path(out_dir)
    marker = layout.read_marker(folder) if layout.is_complete(folder) else {}
    kind = choose_weights(weights_kind, has_average(folder), where=str(folder))
    tensors = consolidated_model_state(folder, kind)
    config_yaml, scale = merged_lora_config(config_yaml)
    tensors, merged = _merge_adapters(tensors, scale, where=str(folder))
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / EXPORT_JSON).unlink(missing_ok=True)  # an older export here is no longer whole from now on
    step = marker.get("step")
    weights = out_dir / WEIGHTS_FILE
    replace_atomically(weights, lambda tmp: save_file(tensors, str(tmp), metadata={
        "format": "pt", "step": str(step), "source": folder.name, WEIGHTS_KIND_KEY: kind}))
    replace_atomically(out_dir / CONFIG_FILE, lambda tmp: tmp.write_text(config_yaml))
    if side_files is not None:
        _copy_side_files(side_files, out_dir)
    summary: dict[str, Any] = {
        "step": step, "source": str(folder.resolve()), "weights": WEIGHTS_FILE, WEIGHTS_KIND_KEY: kind,
        "ema_decay": marker.get("ema_decay") if kind == "ema" else None, "config": CONFIG_FILE,
        "num_tensors": len(tensors), "num_parameters": sum(t.numel() for t in tensors.values()),
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}),
        "bytes": weights.stat().st_size, "sha256": sha256_file(weights), "config_sha256": sha256_text(config_yaml),
        "tensors": safetensors_header(weights), "built_from": built_from(folder, config_yaml, kind),
    }
    if merged:
        summary["lora_merged"] = {"layers": merged, "scale": scale}
    if side_files is not None:
        summary[SIDE_FILES_KEY] = side_file_hashes(out_dir, side_files)
    write_json_atomic(out_dir / EXPORT_JSON, summary)
    return weights


def merged_lora_config(config_yaml: str) -> tuple[str, float | None]:
    """(the config.yaml an export writes, the LoRA scale its weights fold in): a recipe with model.lora trained
    adapters, which the export folds into the base weights (W + alpha/rank * B @ A, models/lora.py); its config then
    names no model.lora (the export is a plain model: evaluation, the LeRobot export and the logged model build it
    without adapters). Any other config comes back as given, with None."""
    import yaml

    from embodyhpc.config.lora_schema import LoraConfig

    data = yaml.safe_load(config_yaml) if "lora" in config_yaml else None
    model = data.get("model") if isinstance(data, dict) else None
    lora = model.get("lora") if isinstance(model, dict) else None
    if not isinstance(lora, dict) or lora.get("rank") is None:
        return config_yaml, None
    scale = LoraConfig(**lora).scale
    del model["lora"]
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False), scale


def _merge_adapters(tensors: dict[str, torch.Tensor], scale: float | None,
                    *, where: str) -> tuple[dict[str, torch.Tensor], int]:
    """The weights with LoRA adapters folded in (merge_lora_state), and how many layers had them."""
    from embodyhpc.models.lora import LORA_A, merge_lora_state

    layers = sum(key.endswith("." + LORA_A) for key in tensors)
    if layers and scale is None:
        raise NotACheckpointError(f"holds LoRA adapters ({layers} layers) and the config it is exported with names no "
                                  "model.lora (their alpha / rank is unknown)", where=where,
                                  fix="export it with the run's own config.yaml")
    if scale is None:
        return tensors, 0
    return merge_lora_state(tensors, scale), layers


def _copy_side_files(side_files: Mapping[str, str | Path | None], out_dir: Path) -> None:
    for name, source in side_files.items():
        target = out_dir / name
        check_side_name(name, where=str(out_dir))  # a plain file name, before anything is copied
        if source is None:
            target.unlink(missing_ok=True)
        elif Path(source).resolve() != target.resolve():
            data = Path(source).read_bytes()
            replace_atomically(target, lambda tmp, data=data: tmp.write_bytes(data))


def load_exported(out_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights and the export summary of an export folder, after checking the weights are byte for byte what
    export.json recorded (integrity.verify_export); every failure is one line (NotACheckpointError)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    summary = verify_export(out_dir)
    try:
        weights = load_file(str(out_dir / WEIGHTS_FILE))
    except (SafetensorError, OSError, ValueError) as exc:
        raise NotACheckpointError(f"unreadable weights ({exc})", where=str(out_dir / WEIGHTS_FILE),
                                  fix=REEXPORT) from None
    return weights, summary


def check_fits(entries: dict[str, tuple[torch.dtype, torch.Size]], model_config: Any, *, where: str,
               built_with: str) -> torch.nn.Module:
    """Refuse weights ({name: (dtype, shape)}) that do not fit the model `model_config` builds: a name missing or
    extra, a shape that differs (another model size, action_dim, ...), or an integer or bool tensor where the model
    holds floats (and back). Floating dtypes may differ (a bf16 export of fp32 training loads into fp32). Builds
    the model on the meta device (no memory, no weights) as inference builds it, without fp8 layers whatever the
    training precision was (fp8 layers hold the same weights under the same names; transformer-engine's need a
    GPU to be built at all), and returns it."""
    from embodyhpc.models import build_model

    with torch.device("meta"):
        model = build_model(model_config)
    wanted = {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}
    missing, extra = sorted(set(wanted) - set(entries)), sorted(set(entries) - set(wanted))
    shapes = sorted(k for k in set(wanted) & set(entries) if tuple(wanted[k][1]) != tuple(entries[k][1]))
    kinds = sorted(k for k in set(wanted) & set(entries)
                   if wanted[k][0].is_floating_point != entries[k][0].is_floating_point)
    problems = []
    if shapes:
        k = shapes[0]
        problems.append(f"{len(shapes)} shapes differ (e.g. {k}: {tuple(entries[k][1])} here, "
                        f"{tuple(wanted[k][1])} in the model)")
    if missing:
        problems.append(f"{len(missing)} model tensors missing (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} tensors the model lacks (e.g. {extra[0]})")
    if kinds:
        k = kinds[0]
        problems.append(f"{len(kinds)} dtypes of the wrong kind (e.g. {k}: {entries[k][0]} here, "
                        f"{wanted[k][0]} in the model)")
    if problems:
        raise NotACheckpointError(f"the weights do not fit the model {built_with} builds (model.size="
                                  f"{getattr(model_config, 'size', '?')}): {'; '.join(problems)}", where=where,
                                  fix="evaluate with the recipe the weights were trained with")
    return model


def load_checked_export(export_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], Any, torch.nn.Module]:
    """An export's weights (checked against export.json's size and sha256), its summary, the recipe it was trained
    with (config.yaml), and the model that recipe builds, on the meta device, once the weights are checked to fit it
    (check_fits): what evaluation and conversions start from."""
    from embodyhpc.config.load import read_config_file
    from embodyhpc.models.spec import check_model_config

    export_dir = Path(export_dir)
    weights, summary = load_exported(export_dir)
    config = read_config_file(export_dir / CONFIG_FILE, check=lambda cfg: check_model_config(cfg.model))
    meta = check_fits({k: (v.dtype, v.shape) for k, v in weights.items()}, config.model,
                      where=str(export_dir), built_with=str(export_dir / CONFIG_FILE))
    return weights, summary, config, meta
