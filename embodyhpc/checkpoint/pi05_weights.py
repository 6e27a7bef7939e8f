"""pi0.5 weights in the published layout for FSDP2-sharded models (models/pi05/weights.py has the layout and the
single-process API; this module adds only the collectives, which models/ must not contain).

Loading: rank 0 reads the safetensors file(s) and converts them to our names (the checks of
models.pi05.weights.plan_load), every rank then calls torch.distributed.checkpoint's `set_model_state_dict` with
`broadcast_from_rank0`, which sends each full tensor from rank 0 and keeps the local shard: one copy of the
weights in host memory on rank 0, none on the other ranks. A layout error found on rank 0 is broadcast first and
raised on every rank (no rank is left waiting in a collective).
Saving: `get_model_state_dict(full_state_dict=True, cpu_offload=True)` gathers full tensors to rank 0's CPU, which
converts and writes them; every rank returns after a barrier.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from embodyhpc.models.pi05.weights import (
    SINGLE_FILE,
    LoadReport,
    SafetensorsCheckpoint,
    WeightsLayoutError,
    convert_published,
    to_published,
)


def _targets(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, torch.dtype]]:
    # A DTensor's .shape is the global shape, so the checks see full sizes on every rank.
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    return {k: tuple(v.shape) for k, v in state.items()}, {k: v.dtype for k, v in state.items()}


def load_pi05_weights_sharded(model: nn.Module, path_or_dir: str | Path, *, strict: bool = True) -> LoadReport:
    """Collective: every rank calls it after parallelize + materialize; returns the same report on every rank."""
    targets, dtypes = _targets(model)
    rank0 = dist.get_rank() == 0
    full: dict[str, torch.Tensor] = {}
    outcome: list[object] = [None]
    if rank0:
        try:
            full, report = convert_published(SafetensorsCheckpoint(path_or_dir), model.shape, targets, strict=strict,
                                             dtypes=dtypes, source_name=str(path_or_dir))
            outcome[0] = report
        except (WeightsLayoutError, FileNotFoundError) as exc:
            outcome[0] = exc
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    report = outcome[0]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict and report.ok)
    set_model_state_dict(model, full, options=options)
    return report


def save_pi05_weights_sharded(model: nn.Module, path: str | Path, *, placeholders: bool = True,
                              dtype: torch.dtype | None = None) -> Path:
    """Collective: gathers the full weights to rank 0, which writes one safetensors file in the published layout."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / SINGLE_FILE
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        full = {k: v for k, v in full.items() if not k.endswith("_extra_state")}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(to_published(full, model.shape, placeholders=placeholders, dtype=dtype), str(path),
                  metadata={"format": "pt", "layout": "openpi-pytorch-pi05"})
    dist.barrier()
    return path
