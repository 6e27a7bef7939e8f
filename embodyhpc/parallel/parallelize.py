"""Apply a ParallelPlan to a model built on the meta device, then materialise it shard by shard.

The sequence every rank runs (launch/train does it):

    with torch.device("meta"):
        model = build_model(model_cfg, precision_cfg)          # no memory, no init
    plan = parallelize(model, parallel_cfg, precision_cfg, mesh)
    torch.manual_seed(seed)
    materialize(model, device)                                  # to_empty + init_weights on the local shards
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
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, distribute_tensor

from embodyhpc.config.schema import ParallelismConfig, PrecisionConfig
from embodyhpc.parallel.ac import apply_activation_checkpointing
from embodyhpc.parallel.mesh import mesh_degrees
from embodyhpc.parallel.plan import ParallelPlan, declared_units, make_plan
from embodyhpc.parallel.precision import check_fp8_conversion, mixed_precision_policy

# Methods other than forward that run the model's parameters (inference). FSDP only gathers parameters around
# forward(); these get the same hooks when the model has them. A model can name its own with
# `fsdp_forward_methods() -> list[str]`.
DEFAULT_FORWARD_METHODS = ("sample_actions",)


def parallelize(model: nn.Module, parallel_cfg: ParallelismConfig, precision_cfg: PrecisionConfig,
                mesh: DeviceMesh) -> ParallelPlan:
    """Wrap `model` in place (AC, compile, FSDP2 on its declared units and the root); returns what was done.

    parallel_cfg and precision_cfg are the recipe's `parallelism` and `precision` sections; mesh comes from
    build_mesh with the resolved degrees. The model must declare `fsdp_units()` (refused otherwise) and, for
    precision.mode=fp8, already hold its fp8 layers (build_model converts them).
    """
    declared_units(model)  # first: refuse a model without declared units before touching anything
    dp_replicate, dp_shard = mesh_degrees(mesh)
    _check_degrees(parallel_cfg, dp_replicate, dp_shard)
    fp8_backend = check_fp8_conversion(model, precision_cfg)
    plan = make_plan(model, parallel_cfg, precision_cfg, dp_replicate=dp_replicate, dp_shard=dp_shard,
                     fp8_backend_in_model=fp8_backend)

    apply_activation_checkpointing(model, plan.ac_units)
    for name in plan.compiled_units:
        model.get_submodule(name).compile()  # in place: same module, same parameter names
    apply_fsdp(model, plan, mesh, mixed_precision_policy(precision_cfg))
    for method in _forward_methods(model):
        register_fsdp_forward_method(model, method)
    return plan


def apply_fsdp(model: nn.Module, plan: ParallelPlan, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """fully_shard on each planned unit (innermost first, as FSDP2 requires), then on the root."""
    keep_gathered = set(plan.unsharded_after_forward)
    for name in sorted(plan.units, key=lambda n: n.count("."), reverse=True):
        fully_shard(model.get_submodule(name), mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=name not in keep_gathered)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate a meta-built, parallelized model's local shards on `device` and fill them with the model's own
    `init_weights()`, seeded by the caller (the same seed on every rank).

    On CUDA-like devices init_weights runs on the DTensor shards directly: DTensor's offset-based RNG gives every
    shard its own part of one random stream, without ever holding a full tensor. CPU has no such RNG (torch warns
    "DTensor random operators may not have complete support"): every rank would draw the same numbers for its
    own shard, and the shards of each weight would be copies of one another. On CPU each parameter is therefore
    initialised at full size and each rank keeps its slice, which makes the result equal to an unsharded build
    initialised from the same seed, at the cost of one unsharded copy of the model in host memory during the
    call (the CPU runs that take this path are tests and demos).

    On GPUs pass the rank's own device (torch.device("cuda", local_rank)); a bare "cuda" means the current one.
    """
    init_weights = getattr(model, "init_weights", None)
    if not callable(init_weights):
        raise TypeError(f"{type(model).__name__} has no init_weights(): a model built on the meta device needs one "
                        "to fill its parameters after sharding (to_empty leaves them uninitialised)")
    device = torch.device(device)
    model.to_empty(device=device)
    with torch.no_grad():
        if device.type != "cpu":
            init_weights()
            return
        _init_full_then_shard(model, init_weights)


def _init_full_then_shard(model: nn.Module, init_weights: Callable[[], None]) -> None:
    """init_weights on full-size stand-ins for the DTensor parameters, then copy each rank's slice back."""
    stand_ins: dict[int, tuple[DTensor, nn.Parameter]] = {}  # by id of the sharded parameter (tied weights: one)
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                continue
            if id(param) not in stand_ins:
                full = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device))
                stand_ins[id(param)] = (param, full)
            module.register_parameter(name, stand_ins[id(param)][1])
            swapped.append((module, name, param))
    try:
        init_weights()
    finally:
        for module, name, sharded in swapped:
            module.register_parameter(name, sharded)
    for sharded, full in stand_ins.values():
        # src_data_rank=None: every rank holds the same full tensor, so each takes its slice locally
        sharded.copy_(distribute_tensor(full.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None))


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
