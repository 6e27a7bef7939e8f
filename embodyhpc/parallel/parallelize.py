"""Apply a ParallelPlan to a model built on the meta device, then materialise it shard by shard.

The sequence every rank runs (launch/train does it):

    with torch.device("meta"):
        model = build_model(model_cfg, precision_cfg)          # no memory, no init
    plan = parallelize(model, parallel_cfg, precision_cfg, mesh)
    materialize(model, device, seed)                            # to_empty + the model's init rules, shard by shard
    log(plan.summary())

Order inside parallelize (the order matters):
1. activation checkpointing wraps each chosen block, so the recomputation happens inside the block's FSDP
   unit, whose parameters FSDP has already all-gathered again for backward;
2. torch.compile compiles each block in place (after AC, so the compiled call contains the checkpointed region;
   FSDP2's hooks, added next, are marked dynamo-disabled and run eagerly around the compiled graph);
3. fully_shard on each declared unit (innermost first, as FSDP2 requires), then on the root, which takes every
   parameter no unit claimed (patch embedding, projections, heads, final norm).

reshard_after_forward: True for every unit (ZeRO-3: a unit's parameters are freed after its forward and
all-gathered again in backward; the memory saving is what lets full-size pi0.5 fit), except the last declared
unit, whose backward comes right after its forward: resharding it would free and re-gather the same bytes at
once. The root keeps FSDP's own default (not resharded, for the same reason).

Backward prefetch: FSDP2 all-gathers, in each unit's pre-backward, the unit that ran before it in forward. A frozen
unit whose backward never runs would be gathered for nothing, once per step: the frozen units before the first one
with a trainable parameter (no gradient reaches them: GR00T's vision tower and LLM when fine-tuned frozen) and frozen
embedding tables (their input is token ids). The unit after such a unit prefetches the nearest earlier unit that
does run backward instead, or nothing (`skip_frozen_prefetch`; declared order is forward order, as above).
Correctness never depends on this: a unit whose backward runs gathers its parameters in its own pre-backward,
prefetched or not (a trainable root parameter running before frozen units, which no shipped model has, would only
cost the overlap).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from embodyhpc.config.schema import ParallelismConfig, PrecisionConfig
from embodyhpc.models.fp8 import checkpoint_fn
from embodyhpc.models.init import init_parameters
from embodyhpc.parallel.ac import apply_activation_checkpointing
from embodyhpc.parallel.dynamic_shapes import mark_inputs_dynamic_hook
from embodyhpc.parallel.mesh import mesh_degrees
from embodyhpc.parallel.plan import ParallelPlan, declared_units, make_plan
from embodyhpc.parallel.precision import check_fp8_conversion, mixed_precision_policy

# Methods other than forward that run the model's parameters (inference). FSDP only gathers parameters around
# forward(); these get the same hooks when the model has them. A model can name its own with
# `fsdp_forward_methods() -> list[str]`.
DEFAULT_FORWARD_METHODS = ("sample_actions",)


def parallelize(model: nn.Module, parallel_cfg: ParallelismConfig, precision_cfg: PrecisionConfig,
                mesh: DeviceMesh, *, compile_backend: str | Callable[[str], Any] | None = None) -> ParallelPlan:
    """Wrap `model` in place (AC, compile, FSDP2 on its declared units and the root); returns what was done.

    parallel_cfg and precision_cfg are the recipe's `parallelism` and `precision` sections; mesh comes from
    build_mesh with the resolved degrees. The model must declare `fsdp_units()` (refused otherwise) and, for
    precision.mode=fp8, already hold its fp8 layers (build_model converts them).
    `compile_backend`: torch.compile's backend for the compiled units (default inductor), or a function of the
    unit's name returning one (compile_stats.CompileStats.backend_for: per-unit counts in tests and benches).
    """
    declared_units(model)  # first: refuse a model without declared units before touching anything
    dp_replicate, dp_shard = mesh_degrees(mesh)
    _check_degrees(parallel_cfg, dp_replicate, dp_shard)
    fp8_backend = check_fp8_conversion(model, precision_cfg)
    plan = make_plan(model, parallel_cfg, precision_cfg, dp_replicate=dp_replicate, dp_shard=dp_shard,
                     fp8_backend_in_model=fp8_backend)

    apply_activation_checkpointing(model, plan.ac_units, checkpoint_fn(precision_cfg))
    for name in plan.compiled_units:
        backend = compile_backend(name) if callable(compile_backend) else (compile_backend or "inductor")
        # in place: same module, same parameter names
        model.get_submodule(name).compile(**compile_options(parallel_cfg, backend))
    apply_fsdp(model, plan, mesh, mixed_precision_policy(precision_cfg))
    for name in plan.compiled_units:  # after fully_shard: see dynamic_shapes.py
        model.get_submodule(name).register_forward_pre_hook(mark_inputs_dynamic_hook, with_kwargs=True)
    for method in _forward_methods(model):
        register_fsdp_forward_method(model, method)
    return plan


def compile_options(parallel_cfg: ParallelismConfig, backend: str | Callable) -> dict[str, Any]:
    """torch.compile's arguments for each compiled unit: the backend, and inductor's reduce-overhead mode (CUDA
    graphs through cudagraph trees) with parallelism.cuda_graphs. Other backends have no modes."""
    if parallel_cfg.cuda_graphs and backend == "inductor":
        return {"backend": backend, "mode": "reduce-overhead"}
    return {"backend": backend}


def apply_fsdp(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """fully_shard on each planned unit (innermost first, as FSDP2 requires), then on the root."""
    keep_gathered = set(plan.unsharded_after_forward)
    for name in sorted(plan.units, key=lambda n: n.count("."), reverse=True):
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=name not in keep_gathered)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    skip_frozen_prefetch(model, plan.units)


def backward_free_units(model: nn.Module, units: tuple[str, ...]) -> list[str]:
    """The declared units whose backward never runs (module doc): frozen before the first unit with a trainable
    parameter, or a frozen embedding table."""
    free, trainable_before = [], False
    for name in units:
        unit = model.get_submodule(name)
        frozen = not any(p.requires_grad for p in unit.parameters())
        if frozen and (not trainable_before or isinstance(unit, nn.Embedding)):
            free.append(name)
        trainable_before = trainable_before or not frozen
    return free


def skip_frozen_prefetch(model: nn.Module, units: tuple[str, ...]) -> list[str]:
    """Keep FSDP2 from all-gathering the units whose backward never runs (module doc) in backward; returns them.

    Each unit (or the root, last in forward) that follows such a unit gets an explicit backward prefetch: the nearest
    earlier unit that runs backward, else itself (FSDP2 reads an empty list as "implicit"; its own parameters are
    what its pre-backward has just gathered, so prefetching them is a no-op)."""
    free = set(backward_free_units(model, units))
    order: list[str | None] = [*units, None]  # None: the root
    for i, name in enumerate(order[1:], start=1):
        if name in free or order[i - 1] not in free:
            continue
        module = model if name is None else model.get_submodule(name)
        earlier = next((unit for unit in reversed(order[:i]) if unit not in free), None)
        module.set_modules_to_backward_prefetch([module if earlier is None else model.get_submodule(earlier)])
    return [name for name in units if name in free]


def materialize(model: nn.Module, device: torch.device | str, seed: int | None = None) -> None:
    """Allocate a meta-built, parallelized model's local shards on `device` and fill every parameter by the model's
    init rules (`model.init_rules`, embodyhpc.models.init), the same code path on every device.

    Each parameter is filled as one full-size tensor on `device` (one parameter at a time: the largest parameter is
    the only extra memory, 2.1 GB for full pi0.5's token embedding in float32), from a generator seeded by `seed`
    and the parameter's name; every rank computes the same tensor and keeps its own slice. The result therefore
    equals an unsharded `init_weights(seed)` element for element on any world size, and the shards of a random
    weight are different parts of one draw (DTensor's own random ops give every rank the same numbers on CPU, and
    writing into a sharded DTensor through a slice updates a temporary, not the shard).

    `seed` None draws one from torch's global generator (as `init_weights()` does): seed it the same on every rank.
    On GPUs pass the rank's own device (torch.device("cuda", local_rank)).
    """
    rules = getattr(model, "init_rules", None)
    if not callable(rules):
        raise TypeError(f"{type(model).__name__} has no init_rules(): a model built on the meta device states how "
                        "each parameter is initialised (embodyhpc.models.init), to fill its shards after sharding "
                        "(to_empty leaves them uninitialised)")
    model.to_empty(device=torch.device(device))
    init_parameters(model, rules, seed, place=_fill_shard)


def _fill_shard(param: torch.Tensor, fill: Callable[[torch.Tensor], None]) -> None:
    """Fill a parameter by its rule: a plain tensor in place; a DTensor through a full-size tensor sliced locally."""
    if not isinstance(param, DTensor):
        fill(param)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
    fill(full)
    # src_data_rank=None: every rank holds the same full tensor, so each takes its slice locally
    param.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None))


def _check_degrees(parallel_cfg: ParallelismConfig, dp_replicate: int, dp_shard: int) -> None:
    if parallel_cfg.dp_replicate != dp_replicate or parallel_cfg.dp_shard not in (-1, dp_shard):
        raise ValueError(f"the mesh (dp_replicate={dp_replicate}, dp_shard={dp_shard}) was not built from this "
                         f"parallelism section (dp_replicate={parallel_cfg.dp_replicate}, "
                         f"dp_shard={parallel_cfg.dp_shard}): build it with build_mesh(resolved.dp_replicate, "
                         "resolved.dp_shard, ...)")


def _forward_methods(model: nn.Module) -> list[str]:
    declare = getattr(model, "fsdp_forward_methods", None)
    names = list(declare()) if callable(declare) else [n for n in DEFAULT_FORWARD_METHODS if hasattr(model, n)]
    return names
