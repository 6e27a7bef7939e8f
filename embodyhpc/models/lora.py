"""LoRA: low-rank adapters on a model's Linear layers, the base weights frozen (`model.lora`, config/lora_schema.py).

    apply_lora(model, model_cfg.lora, presets)   # in the family's build, on the meta device, before parallel/ wraps it
    merge_lora(model)                            # every LoRALinear -> a plain nn.Linear holding W + scale * B @ A
    merge_lora_state(state, scale)               # the same on a state dict (exports read checkpoints, not modules)

What `apply_lora` does: every parameter of the model is frozen (requires_grad False: no gradient, no optimizer state,
no moving average), then each targeted nn.Linear becomes a LoRALinear holding the same `weight` and `bias` parameters
under the same names plus two trainable ones, `lora_A` (rank x in) and `lora_B` (out x rank):

    y = x W^T + b + scale * dropout(x) A^T B^T,   scale = alpha / rank

`lora_B` starts at zero, so the adapted model computes exactly what the base model computes until the first optimizer
step; `lora_A` starts as a normal draw (std 1/sqrt(in_features): lora_a_std) so B's gradient is not zero. The base
parameters keep their names, so published weights and embodyhpc exports load into an adapted model unchanged (the
adapters are not in them: they start where `apply_lora` put them); checkpoints hold `<layer>.lora_A`/`.lora_B` beside
`<layer>.weight`.

Targets: each entry of model.lora.targets is a preset of the family (a name in `presets`, expanded to its patterns)
or an fnmatch pattern (fnmatchcase: `*` matches any run of characters, dots included) matched against the canonical
qualified names of the model's Linear layers (wrapper prefixes removed, e.g. `layers.3.expert.q_proj`). A target
that matches no layer, or only layers that are not nn.Linear (an fp8 library's Linear, a norm, a block), is refused in
one line naming it.

Initialisation: the model's own init rules (models/init.py) do not know lora_A/lora_B; `apply_lora` extends the model's
`init_rules` with theirs, so parallel/'s materialize fills them on the shards like every other parameter.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from embodyhpc.errors import ConfigError
from embodyhpc.models.init import Constant, Normal, canonical_name, linear_like

LORA_A, LORA_B = "lora_A", "lora_B"


ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
"""The state-dict keys a LoRALinear adds to its Linear's: no export or published checkpoint has them (exports are
merged), so loading init weights leaves them at their own init (B = 0: the adapted model starts as the base)."""


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update scale * B @ A (module docstring); `weight` and `bias` are the base's own."""

    def __init__(self, in_features: int, out_features: int, *, rank: int, scale: float, dropout: float = 0.0,
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.scale = rank, scale
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=device, dtype=dtype))
        self.lora_dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    @classmethod
    def wrap(cls, linear: nn.Linear, *, rank: int, scale: float, dropout: float = 0.0) -> LoRALinear:
        """A LoRALinear around `linear`'s own weight and bias (the same Parameter objects, frozen)."""
        weight = linear.weight
        module = cls(linear.in_features, linear.out_features, rank=rank, scale=scale, dropout=dropout,
                     bias=linear.bias is not None, device=weight.device, dtype=weight.dtype)
        module.weight = weight
        module.bias = linear.bias
        for param in (module.weight, module.bias):
            if param is not None:
                param.requires_grad_(False)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return base + self.scale * update

    def merged(self) -> nn.Linear:
        """A plain nn.Linear holding W + scale * B @ A (and the same bias), computed in fp32."""
        with torch.no_grad():
            weight = merged_weight(self.weight, self.lora_A, self.lora_B, self.scale)
            plain = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                              device=weight.device, dtype=weight.dtype)
            plain.weight.copy_(weight)
            if self.bias is not None:
                plain.bias.copy_(self.bias)
        return plain

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in fp32, returned in W's dtype."""
    update = lora_b.to(torch.float32) @ lora_a.to(torch.float32)
    return (weight.to(torch.float32) + scale * update).to(weight.dtype)


def lora_a_std(in_features: int) -> float:
    """The std of lora_A's normal draw: 1/sqrt(in_features), the scale of Kaiming-uniform's draw that LoRA's reference
    implementation and PEFT use (a product A x of unit variance per component for unit-variance inputs)."""
    return 1.0 / math.sqrt(in_features)


def lora_rules(fqn: str, module: nn.Module) -> dict:
    """The init rules of a LoRALinear's adapters: A normal (lora_a_std), B zero (the step-0 model is the base)."""
    if isinstance(module, LoRALinear):
        return {LORA_A: Normal(lora_a_std(module.in_features)), LORA_B: Constant(0.0)}
    return {}


def resolve_targets(model: nn.Module, targets: Iterable[str], presets: Mapping[str, tuple[str, ...]],
                    default: tuple[str, ...]) -> list[str]:
    """The canonical names of the nn.Linear layers `targets` select (module docstring), in module order; one-line
    ConfigErrors for a target matching nothing or no nn.Linear."""
    targets = list(targets) or list(default)
    modules = {canonical_name(name): module for name, module in model.named_modules() if name}
    chosen: set[str] = set()
    for i, target in enumerate(targets):
        patterns = presets.get(target, (target,))
        matched = [name for name in modules if any(fnmatch.fnmatchcase(name, p) for p in patterns)]
        linears = [name for name in matched if type(modules[name]) in (nn.Linear, LoRALinear)]
        key = f"model.lora.targets[{i}]"
        if not matched:
            raise ConfigError(f"{target!r} matches no layer of the model", key=key,
                              fix=f"use a preset ({', '.join(presets)}) or an fnmatch pattern of a Linear layer's "
                                  f"name, e.g. {_example(modules)}")
        if not linears:
            other = matched[0]
            kind = "an fp8 Linear (LoRA wraps nn.Linear only)" if linear_like(modules[other]) else \
                f"a {type(modules[other]).__name__}, not a Linear layer"
            raise ConfigError(f"{target!r} matches {other!r}, {kind}", key=key,
                              fix=f"name Linear layers, e.g. {_example(modules)}")
        chosen.update(linears)
    return [name for name in modules if name in chosen]


def _example(modules: Mapping[str, nn.Module]) -> str:
    linear = next((name for name, m in modules.items() if type(m) is nn.Linear), "none")
    return repr(linear)


def apply_lora(model: nn.Module, lora_cfg, presets: Mapping[str, tuple[str, ...]],
               default: tuple[str, ...]) -> list[str]:
    """Freeze `model` and put adapters on the targeted Linear layers (module docstring), in place; returns their
    names. No-op (returns []) when lora_cfg is off. Call before parallel/ wraps the model."""
    if lora_cfg is None or not lora_cfg.enabled:
        return []
    names = resolve_targets(model, lora_cfg.targets, presets, default)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        if isinstance(linear, LoRALinear):
            raise ValueError(f"{name} already holds LoRA adapters")
        setattr(parent, child, LoRALinear.wrap(linear, rank=lora_cfg.rank, scale=lora_cfg.scale,
                                               dropout=lora_cfg.dropout))
    with torch.no_grad():  # a model built off the meta device has initialised itself already: its adapters too
        for layer in lora_layers(model).values():
            if not layer.lora_A.is_meta:
                layer.lora_A.normal_(0.0, lora_a_std(layer.in_features))
    base_rules = model.init_rules

    def rules(fqn: str, module: nn.Module) -> dict:
        return {**base_rules(fqn, module), **lora_rules(fqn, module)}

    model.init_rules = rules  # an instance attribute: parallel/'s materialize and init_weights read it
    return names


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {canonical_name(name): m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear of `model` by its merged nn.Linear (in place; returns the model)."""
    for name in list(lora_layers(model)):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, getattr(parent, child).merged())
    return model


def merge_lora_state(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A state dict with each `<layer>.lora_A`/`<layer>.lora_B` pair folded into `<layer>.weight` (merged_weight) and
    dropped; a state dict without adapters comes back unchanged. A lone half of a pair is refused."""
    merged = dict(state)
    layers = {key[:-len(LORA_A) - 1] for key in state if key.endswith("." + LORA_A)}
    halves = {key[:-len(LORA_B) - 1] for key in state if key.endswith("." + LORA_B)}
    if layers != halves:
        odd = sorted(layers ^ halves)[0]
        raise ValueError(f"{odd} has only one of {LORA_A}/{LORA_B}")
    for layer in sorted(layers):
        lora_a, lora_b = merged.pop(f"{layer}.{LORA_A}"), merged.pop(f"{layer}.{LORA_B}")
        merged[f"{layer}.weight"] = merged_weight(merged[f"{layer}.weight"], lora_a, lora_b, scale)
    return merged


def trainable_count(model: nn.Module) -> tuple[int, int]:
    """(trainable parameters, all parameters)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)
