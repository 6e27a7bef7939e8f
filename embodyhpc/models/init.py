"""Parameter initialisation as data: a model states one rule per parameter, one loop applies the rules.

Why rules rather than an `init_weights()` that writes into the parameters:
- A model built on the meta device is materialised after FSDP2 has sharded it (embodyhpc.parallel.materialize).
  Writing into a sharded DTensor in place is where initialisation went wrong: a slice assignment such as
  `bias[2 * dim:] = 1` on a sharded DTensor writes into a redistributed temporary and leaves the shard untouched
  (the adaRMS gate started at 0 on GPUs and at 1 on CPU). With rules, every parameter is filled as a whole,
  full-size tensor, one parameter at a time, and each rank keeps its slice: the same code on every device, equal to
  the unsharded initialisation element for element, with one parameter's worth of extra memory at most.
- Every parameter must have a rule: `parameter_rules` refuses a model holding a parameter nobody initialises (a
  new layer type, a third-party Linear such as transformer-engine's, which is not an nn.Linear), instead of
  leaving it as whatever memory `to_empty` handed out (different on every rank).

Random rules draw from a generator of their own, seeded from the run's seed and the parameter's canonical name
(wrapper prefixes such as activation checkpointing's removed), so values depend neither on the order parameters
are visited nor on the world size nor on the wrappers.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

# module names wrappers insert between a parent and the wrapped module: activation checkpointing (torch's
# checkpoint_wrapper) and torch.compile's OptimizedModule
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod")


@dataclass(frozen=True)
class Normal:
    std: float
    mean: float = 0.0


@dataclass(frozen=True)
class Constant:
    value: float


@dataclass(frozen=True)
class Pieces:
    """Constant runs along dim 0: ((length, value), ...), lengths summing to the parameter's first dim."""

    runs: tuple[tuple[int, float], ...]


Rule = Normal | Constant | Pieces


@dataclass(frozen=True)
class ParameterInit:
    module: nn.Module
    """The module that owns the parameter (named_parameters(recurse=False))."""
    name: str
    """The parameter's name on that module."""
    fqn: str
    """Its canonical name in the model (wrapper prefixes removed): seeds a random rule."""
    rule: Rule


def canonical_name(fqn: str) -> str:
    """`layers.0._checkpoint_wrapped_module.vlm.q_proj` -> `layers.0.vlm.q_proj`."""
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_NAMES)


def fill_(tensor: torch.Tensor, rule: Rule, generator: torch.Generator | None) -> torch.Tensor:
    """Fill a plain (unsharded) tensor in place by `rule`."""
    if isinstance(rule, Normal):
        return tensor.normal_(rule.mean, rule.std, generator=generator)
    if isinstance(rule, Constant):
        return tensor.fill_(rule.value)
    if sum(length for length, _ in rule.runs) != tensor.shape[0]:
        raise ValueError(f"runs {rule.runs} do not cover dim 0 of a {tuple(tensor.shape)} tensor")
    start = 0
    for length, value in rule.runs:
        tensor[start:start + length].fill_(value)
        start += length
    return tensor


def parameter_seed(seed: int, fqn: str) -> int:
    """The seed of one parameter's random rule: a function of the run's seed and the parameter's name only."""
    return (seed * 1_000_003 + zlib.crc32(fqn.encode())) % (2**63 - 1)


def parameter_rules(model: nn.Module, rules: Callable[[str, nn.Module], dict[str, Rule]]) -> list[ParameterInit]:
    """One ParameterInit per parameter of `model`, in named_modules order.

    `rules(canonical module name, module)` returns {parameter name: rule} for the parameters the module owns
    directly; a later (deeper) module cannot override an earlier one, but a model can give a parent's rule for a
    child's parameter by naming it `child.param` (e.g. an adaptive norm stating its modulation Linear's init).
    A parameter left without a rule is refused, naming it and its module type.
    """
    stated: dict[tuple[int, str], Rule] = {}
    for fqn, module in model.named_modules():
        for name, rule in rules(canonical_name(fqn), module).items():
            owner_path, _, param = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            stated.setdefault((id(owner), param), rule)
    found, seen = [], set()
    for fqn, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights: filled once
                continue
            seen.add(id(param))
            rule = stated.get((id(module), name))
            full = canonical_name(f"{fqn}.{name}" if fqn else name)
            if rule is None:
                raise TypeError(f"{type(model).__name__} states no init rule for parameter {full!r} of "
                                f"{type(module).__module__}.{type(module).__name__}: add one to its init rules "
                                "(a parameter left out would keep uninitialised memory, different on every rank)")
            found.append(ParameterInit(module, name, full, rule))
    return found


def init_parameters(model: nn.Module, rules: Callable[[str, nn.Module], dict[str, Rule]], seed: int | None = None,
                    *, place: Callable[[torch.Tensor, Callable[[torch.Tensor], None]], None] | None = None) -> None:
    """Fill every parameter of `model` by its rule (see the module doc); buffers are refused unless absent.

    `seed`: the run's seed; None draws one from torch's global generator (so `torch.manual_seed(s)` before a build
    or a materialize makes them agree). `place(param, fill)`: how to fill a parameter that is not a plain tensor
    (embodyhpc.parallel passes one for DTensor shards: fill a full-size tensor, keep this rank's slice); by default
    parameters are filled in place.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise TypeError(f"{type(model).__name__} holds buffers ({', '.join(buffers[:4])}) that no init rule covers: "
                        "materialize cannot fill them after to_empty; compute them in forward instead")
    with torch.no_grad():
        for item in parameter_rules(model, rules):
            param = getattr(item.module, item.name)

            def fill(tensor: torch.Tensor, item: ParameterInit = item) -> None:
                generator = None
                if isinstance(item.rule, Normal):
                    generator = torch.Generator(device=tensor.device)
                    generator.manual_seed(parameter_seed(seed, item.fqn))
                fill_(tensor, item.rule, generator)

            if place is None:
                fill(param)
            else:
                place(param, fill)


def linear_like(module: nn.Module) -> bool:
    """nn.Linear and the Linear layers of fp8 libraries: torchao's Float8Linear subclasses nn.Linear,
    transformer-engine's Linear does not (it subclasses nn.Module) but has in_features, out_features and a 2-D
    weight."""
    if isinstance(module, nn.Linear):
        return True
    weight = getattr(module, "weight", None)
    return (hasattr(module, "in_features") and hasattr(module, "out_features") and isinstance(weight, torch.Tensor)
            and weight.ndim == 2)


def owned(module: nn.Module, names: Iterable[str]) -> Iterator[str]:
    """The names among `names` that are parameters the module owns directly (a bias=False layer has none)."""
    direct = dict(module.named_parameters(recurse=False))
    return (name for name in names if name in direct)
