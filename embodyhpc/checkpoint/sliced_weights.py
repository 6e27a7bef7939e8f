"""Weights of FSDP2-sharded models, for any model plug-in: the model's published-weights adapter (its spec's
`weights`, e.g. models/pi05/weights.py ADAPTER) states the key rules; this module adds what needs torch.distributed,
which models/ must not import.

Loading (`load_weights_sharded`, and `load_init_weights` for `model.init_weights`): every rank opens the
safetensors file(s) (memory-mapped) and reads only the rows of each tensor that its FSDP shard holds, converting
them to our layout on the way (models.weights_io.KeyRule.read_rows). No rank ever holds the full model: a rank
reads about 1/world of the bytes, and at most one shard of one tensor at a time besides its own parameters. The
layout checks (the adapter's plan_load) run on every rank; the ranks agree on the outcome before anything is
written, so an error is raised on every rank and none is left waiting in a collective. Floating tensors are cast to
the model's dtypes; a non-floating tensor where the model has a floating one is refused, naming the key.
The source is a published checkpoint in the adapter's layout (pi0.5: openpi / LeRobot; a file, a folder with
model.safetensors, or a sharded index, whose shards must be plain file names beside it: "../x" or "/abs" is refused
before any rank opens it) or an embodyhpc export (a folder with model.safetensors in our own names).
Saving: `get_model_state_dict(full_state_dict=True, cpu_offload=True)` gathers full tensors to rank 0's CPU, which
converts and writes them; every rank returns after a barrier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor, Shard

from embodyhpc.models.lora import ADAPTER_SUFFIXES
from embodyhpc.models.weights_io import SINGLE_FILE, KeyRule, LoadReport, SafetensorsCheckpoint, WeightsLayoutError


class WeightsAdapter(Protocol):
    """A model's published-weights layout (ModelSpec.weights): its key rules, both ways."""

    layout: str
    """Written into saved files' metadata."""

    def plan_load(self, source: SafetensorsCheckpoint, model: nn.Module, targets: Mapping[str, tuple[int, ...]], *,
                  strict: bool, source_name: str) -> tuple[LoadReport, list[tuple[KeyRule, str]]]: ...

    def to_published(self, state: Mapping[str, torch.Tensor], model: nn.Module, *, placeholders: bool = True,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]: ...


@dataclass
class ReadStats:
    """What one rank read: bytes in all, and the largest single read (its peak beyond its own parameters)."""

    bytes_read: int = 0
    largest_read: int = 0


def _targets(model: nn.Module) -> dict[str, torch.Tensor]:
    # A DTensor's .shape is the global shape, so the checks see full sizes on every rank. LoRA adapters are no
    # tensor of any base checkpoint: they keep their own init (models/lora.py)
    return {k: v for k, v in model.state_dict().items() if not k.endswith(("_extra_state", *ADAPTER_SUFFIXES))}


def local_rows(tensor: torch.Tensor) -> tuple[int, int]:
    """The dim-0 rows [start, stop) of the full tensor that this rank's shard holds (all rows if not sharded).

    FSDP2 shards dim 0 as torch.chunk does (chunks of ceil(n / size) rows, the last ones shorter or empty); HSDP adds
    a replicated mesh dimension, which changes nothing here.
    """
    if not isinstance(tensor, DTensor) or tensor.dim() == 0:
        return 0, tensor.shape[0] if tensor.dim() else 0
    start, stop = 0, tensor.shape[0]
    for mesh_dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard):
            if placement.dim != 0:
                raise ValueError(f"shards along dim {placement.dim}: only dim-0 (FSDP) sharding is read in slices")
            size, coord = tensor.device_mesh.size(mesh_dim), tensor.device_mesh.get_local_rank(mesh_dim)
            chunk = -(-(stop - start) // size)
            start, stop = min(start + coord * chunk, stop), min(start + (coord + 1) * chunk, stop)
    if stop - start != tensor.to_local().shape[0]:
        raise ValueError(f"shard of {tuple(tensor.shape)} holds {tensor.to_local().shape[0]} rows, expected "
                         f"{stop - start}")
    return start, stop


def _own_layout(source: SafetensorsCheckpoint, targets: dict[str, torch.Tensor], name: str,
                strict: bool) -> tuple[LoadReport, list[tuple[KeyRule, str]]]:
    """An embodyhpc export: the file holds our own names."""
    report = LoadReport(source=name)
    keys = set(source.keys())
    for ours, tensor in targets.items():
        if ours not in keys:
            report.missing.append(ours)
        elif source.shape(ours) != tuple(tensor.shape):
            report.mismatched.append((ours, tuple(tensor.shape), source.shape(ours)))
        else:
            report.loaded.append(ours)
    report.unexpected = sorted(keys - set(targets))
    if report.mismatched:
        key, want, got = report.mismatched[0]
        raise WeightsLayoutError(f"{name}: {len(report.mismatched)} shape mismatch(es), first {key}: model "
                                 f"{list(want)} vs checkpoint {list(got)}")
    if strict and (report.missing or report.unexpected):
        raise WeightsLayoutError(f"{name}: missing {report.missing[:4]}, unexpected {report.unexpected[:4]} "
                                 "(not the same model: check model.size and the action/state dims)")
    return report, [(KeyRule(k, k), k) for k in report.loaded]


def _holds_our_names(source: SafetensorsCheckpoint, model: nn.Module, targets: dict[str, torch.Tensor],
                     adapter: WeightsAdapter | None, name: str) -> bool:
    """Whether the file is an embodyhpc export (our own names) rather than the adapter's published layout. A
    published layout may share many names with ours (GR00T's action head keeps its published names: most of the
    tiny model's tensors), so the file is ours when it holds more of our names than the adapter would load from it.
    """
    shared = len(set(targets) & set(source.keys()))
    if shared * 2 <= len(targets):
        return False
    if adapter is None:
        return True
    try:
        report, _ = adapter.plan_load(source, model, {k: tuple(v.shape) for k, v in targets.items()}, strict=False,
                                      source_name=name)
    except WeightsLayoutError:
        if shared == len(targets):  # a complete export the published rules cannot read at all
            return True
        raise
    return shared > len(report.loaded)


def _plan(model: nn.Module, path: str | Path, targets: dict[str, torch.Tensor], adapter: WeightsAdapter | None,
          strict: bool) -> tuple[SafetensorsCheckpoint, LoadReport, list[tuple[KeyRule, str]]]:
    name = str(path)
    try:
        source = SafetensorsCheckpoint(path)  # refuses an index naming a shard outside its folder (weights_io)
    except (FileNotFoundError, WeightsLayoutError):
        raise
    except Exception as exc:  # safetensors' own error type for a damaged header
        raise WeightsLayoutError(f"{name}: not a readable safetensors checkpoint ({exc})") from None
    if _holds_our_names(source, model, targets, adapter, name):
        report, to_load = _own_layout(source, targets, name, strict)
    elif adapter is None:
        raise WeightsLayoutError(f"{name}: not an embodyhpc export of this model, and the model reads no published "
                                 "layout (its spec has no weights adapter)")
    else:
        report, to_load = adapter.plan_load(source, model, {k: tuple(v.shape) for k, v in targets.items()},
                                            strict=strict, source_name=name)
    for rule, key in to_load:
        if targets[rule.ours].is_floating_point() and not source.dtype(key).startswith(("F", "BF")):
            raise WeightsLayoutError(f"{name}: {key} holds {source.dtype(key)} values where the model has "
                                     f"{targets[rule.ours].dtype} (not weights of this model)")
    return source, report, to_load


def load_weights_sharded(model: nn.Module, path_or_dir: str | Path, adapter: WeightsAdapter | None, *,
                         strict: bool = True, stats: ReadStats | None = None) -> LoadReport:
    """Collective: every rank calls it after parallelize + materialize; returns the same report on every rank."""
    targets = _targets(model)
    outcome: object
    try:
        source, report, to_load = _plan(model, path_or_dir, targets, adapter, strict)
        outcome = None
    except (WeightsLayoutError, OSError, ValueError) as exc:
        outcome = exc
    if dist.is_initialized():  # every rank learns whether any rank failed, before anything is written
        outcomes: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, None if outcome is None else f"{type(outcome).__name__}: {outcome}")
        failed = [o for o in outcomes if o is not None]
        if failed and outcome is None:
            raise WeightsLayoutError(f"another rank could not load {path_or_dir}: {failed[0]}")
    if outcome is not None:
        raise outcome
    stats = stats if stats is not None else ReadStats()
    with torch.no_grad():
        for rule, key in to_load:
            target = targets[rule.ours]
            local = target.to_local() if isinstance(target, DTensor) else target
            start, stop = local_rows(target)
            if local.numel() == 0:
                continue
            rows = rule.read_rows(lambda a, b, key=key: source.get_rows(key, a, b), start, stop, tuple(target.shape))
            stats.bytes_read += rows.numel() * rows.element_size()
            stats.largest_read = max(stats.largest_read, rows.numel() * rows.element_size())
            local.copy_(rows.reshape(local.shape).to(local.dtype))
    return report


def load_init_weights(model: nn.Module, path: str | Path, adapter: WeightsAdapter | None) -> LoadReport:
    """`model.init_weights`: a fresh run's step-0 weights from a published checkpoint (the adapter's layout) or an
    embodyhpc export (strict: every tensor of the model must be in the file; keys the model does not use are
    ignored)."""
    return load_weights_sharded(model, path, adapter, strict=True)


def save_weights_sharded(model: nn.Module, path: str | Path, adapter: WeightsAdapter, *, placeholders: bool = True,
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
        save_file(adapter.to_published(full, model, placeholders=placeholders, dtype=dtype), str(path),
                  metadata={"format": "pt", "layout": adapter.layout})
    dist.barrier()
    return path
