"""What parallelize() will do to a model, decided before anything is wrapped: a pure function of the model's
declared units and the recipe's `parallelism` and `precision` sections, so the same summary can be logged, put in
MLflow params and asserted in tests.

Units are the modules a model declares with `fsdp_units()`; embodyhpc/parallel never guesses them (a block list
found by walking the model would silently shard the wrong things on the next model). Activation checkpointing and
compile apply to the declared units that are blocks, i.e. that have submodules: a leaf unit such as an embedding
table is a single op, so recomputing it saves no memory and compiling it alone gains nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from torch import nn

from embodyhpc.config.schema import ParallelismConfig, PrecisionConfig

_DTYPES = {"fp32": ("float32", "float32"), "bf16": ("bfloat16", "float32"), "fp8": ("bfloat16", "float32")}


@dataclass(frozen=True)
class ParallelPlan:
    dp_replicate: int
    """Replicas (HSDP); 1 = plain FSDP."""
    dp_shard: int
    """Ranks each parameter is sharded over."""
    units: tuple[str, ...]
    """FQNs of the declared wrap units, in declared order; each gets its own fully_shard group, then the root."""
    ac_mode: str
    """none, full or every_k (parallelism.activation_checkpointing)."""
    ac_units: tuple[str, ...]
    """Units wrapped in activation checkpointing."""
    compiled_units: tuple[str, ...]
    """Units compiled one by one with torch.compile."""
    param_dtype: str
    """dtype parameters are all-gathered and computed in."""
    reduce_dtype: str
    """dtype gradients are reduce-scattered (and all-reduced across replicas) in."""
    fp8: str
    """off, torchao (float8 all-gather of the fp8 layers' weights) or te."""
    unsharded_after_forward: tuple[str, ...]
    """Units FSDP keeps gathered between forward and backward (the root is always among them)."""
    cuda_graphs: bool = False
    """Compiled units replay as CUDA graphs (parallelism.cuda_graphs; inductor's reduce-overhead mode)."""

    @property
    def mode(self) -> str:
        return "HSDP" if self.dp_replicate > 1 else "FSDP"

    def as_dict(self) -> dict[str, object]:
        """Flat values for MLflow params and JSON logs (tuples joined by commas)."""
        flat: dict[str, object] = {"mode": self.mode}
        for key, value in asdict(self).items():
            flat[key] = ",".join(value) if isinstance(value, tuple) else value
        return flat

    def summary(self) -> str:
        """One line for the training log."""
        ac = self.ac_mode if self.ac_mode == "none" else f"{self.ac_mode} ({len(self.ac_units)} units)"
        return (f"{self.mode} dp_replicate={self.dp_replicate} dp_shard={self.dp_shard}; "
                f"{len(self.units)} units + root; AC {ac}; compile {len(self.compiled_units)} units"
                f"{' as CUDA graphs' if self.cuda_graphs else ''}; "
                f"params {self.param_dtype}, reduce {self.reduce_dtype}, fp8 {self.fp8}")


def declared_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(fqn, module) for each unit of `model.fsdp_units()`, in declared order; refuses models that declare none."""
    declare = getattr(model, "fsdp_units", None)
    if not callable(declare):
        raise TypeError(
            f"{type(model).__name__} does not declare its FSDP wrap units: add a method `fsdp_units(self) -> "
            "list[nn.Module]` returning the blocks to shard one by one (e.g. the transformer layers). "
            "embodyhpc/parallel does not guess them.")
    names = {id(module): name for name, module in model.named_modules()}
    units, seen = [], set()
    for module in declare():
        name = names.get(id(module))
        if not name:  # "" is the root itself; None is a module outside the model
            where = "the model itself" if name == "" else "not a submodule of the model"
            raise ValueError(f"{type(model).__name__}.fsdp_units() returned {type(module).__name__}, {where}; "
                             "units must be proper submodules (the root is sharded last on its own)")
        if name in seen:
            raise ValueError(f"{type(model).__name__}.fsdp_units() lists {name!r} twice")
        seen.add(name)
        units.append((name, module))
    if not units:
        raise ValueError(f"{type(model).__name__}.fsdp_units() returned no units; FSDP of the root alone would "
                         "gather the whole model at once")
    return units


def is_block(module: nn.Module) -> bool:
    """Units that activation checkpointing and compile apply to: those with submodules (see the module doc)."""
    return next(module.children(), None) is not None


def make_plan(model: nn.Module, parallel_cfg: ParallelismConfig, precision_cfg: PrecisionConfig, *,
              dp_replicate: int, dp_shard: int, fp8_backend_in_model: str = "off") -> ParallelPlan:
    """The plan for `model` under the recipe's `parallelism` and `precision` sections and the resolved degrees."""
    units = declared_units(model)
    blocks = [name for name, module in units if is_block(module)]
    if parallel_cfg.activation_checkpointing == "full":
        ac_units = blocks
    elif parallel_cfg.activation_checkpointing == "every_k":  # the k-th, 2k-th, ... block (1-based)
        k = parallel_cfg.ac_every_k
        ac_units = [name for i, name in enumerate(blocks, start=1) if i % k == 0]
    else:
        ac_units = []
    param_dtype, reduce_dtype = _DTYPES[precision_cfg.mode]
    return ParallelPlan(
        dp_replicate=dp_replicate, dp_shard=dp_shard, units=tuple(name for name, _ in units),
        ac_mode=parallel_cfg.activation_checkpointing, ac_units=tuple(ac_units),
        compiled_units=tuple(blocks) if parallel_cfg.compile else (),
        param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        fp8=fp8_backend_in_model if precision_cfg.mode == "fp8" else "off",
        # the last declared unit runs last in forward and first in backward: resharding it would be followed at
        # once by the same all-gather (one wasted collective per step for one unit's worth of memory)
        unsharded_after_forward=(units[-1][0], "<root>"),
        cuda_graphs=parallel_cfg.compile and parallel_cfg.cuda_graphs,
    )
