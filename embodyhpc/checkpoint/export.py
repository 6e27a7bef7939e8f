"""Consolidated weights for evaluation and for users: one safetensors file + the resolved config.

The weights are read back from a complete DCP folder by one process, not gathered from the live model: DCP puts
every shard of every saving rank into a plain full-size tensor, without collectives, so the export can run on
rank 0 alone, after the job (`embodyhpc export`), or inside an evaluation job. Only the model's entries are read;
the optimizer (2x the weights for AdamW) stays on disk. Peak memory: the full model, once, on the CPU.

    <out_dir>/
        model.safetensors   the model's state_dict (parameter names of the plain, unwrapped module)
        config.yaml         the resolved recipe the weights were trained with, as given
        export.json         step, source folder, counts: written last, so its presence means the export is whole
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from embodyhpc.checkpoint import layout
from embodyhpc.checkpoint.errors import NotACheckpointError
from embodyhpc.checkpoint.state import MODEL_KEY
from embodyhpc.rundir import write_json_atomic

WEIGHTS_FILE, CONFIG_FILE, EXPORT_JSON = "model.safetensors", "config.yaml", "export.json"


def consolidated_model_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a complete checkpoint folder, in the dtypes it was saved in."""
    folder = Path(folder)
    if not layout.is_complete(folder):
        raise NotACheckpointError(f"no {layout.MARKER} marker: not a complete checkpoint", where=str(folder),
                                  fix="pass a step-N folder that has the marker (checkpoints/latest names one)")
    reader = FileSystemReader(folder)
    prefix = MODEL_KEY + "."
    state: dict[str, torch.Tensor] = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if not key.startswith(prefix):
            continue
        if not isinstance(meta, TensorStorageMetadata):  # e.g. a module's _extra_state: no place in safetensors
            raise NotACheckpointError(f"model entry {key!r} is not a tensor; safetensors holds tensors only",
                                      where=str(folder))
        state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not state:
        raise NotACheckpointError(f"no {MODEL_KEY!r} entries in the checkpoint", where=str(folder))
    # Keys are DCP's flattened names ("model.<fqn>"), which match the flat dict as given. no_dist: one process
    # reads every shard, no collectives (DCP warns about exactly that when no process group is up).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len(prefix):]: tensor for key, tensor in state.items()}


def export_consolidated(folder: str | Path, out_dir: str | Path, *, config_yaml: str,
                        dtype: torch.dtype | None = None) -> Path:
    """Write <out_dir>/model.safetensors, config.yaml and export.json from a complete checkpoint folder.

    `dtype` casts floating-point tensors (e.g. torch.bfloat16 to halve the file); None keeps the saved dtypes.
    Returns the weights path.
    """
    from safetensors.torch import save_file  # the `train` extra; imported here so the package imports without it

    folder, out_dir = Path(folder), Path(out_dir)
    marker = layout.read_marker(folder) if layout.is_complete(folder) else {}
    tensors = consolidated_model_state(folder)
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / EXPORT_JSON).unlink(missing_ok=True)  # an older export here is no longer whole from now on
    step = marker.get("step")
    weights = out_dir / WEIGHTS_FILE
    _replace_atomically(weights, lambda tmp: save_file(tensors, str(tmp), metadata={
        "format": "pt", "step": str(step), "source": folder.name}))
    _replace_atomically(out_dir / CONFIG_FILE, lambda tmp: tmp.write_text(config_yaml))
    summary: dict[str, Any] = {
        "step": step, "source": str(folder.resolve()), "weights": WEIGHTS_FILE, "config": CONFIG_FILE,
        "num_tensors": len(tensors), "num_parameters": sum(t.numel() for t in tensors.values()),
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()}),
        "bytes": weights.stat().st_size,
    }
    write_json_atomic(out_dir / EXPORT_JSON, summary)
    return weights


def load_exported(out_dir: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The weights and the export summary of an export folder (raises if the export is not whole)."""
    from safetensors.torch import load_file

    out_dir = Path(out_dir)
    if not (out_dir / EXPORT_JSON).is_file():
        raise NotACheckpointError(f"no {EXPORT_JSON}: not a finished export", where=str(out_dir),
                                  fix="run the export again")
    return load_file(str(out_dir / WEIGHTS_FILE)), json.loads((out_dir / EXPORT_JSON).read_text())


def _replace_atomically(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
