"""`precision.mode: fp8`: matmuls of the transformer blocks in float8, everything else in high precision.

Which layers go to fp8 (`fp8_linear_filter`, one rule for both backends):
  an nn.Linear inside a transformer block (vision.blocks.*, layers.* — attention projections and MLPs of the VLM
  and the action expert) whose in and out features are both multiples of 16 (float8 GEMMs need that alignment).
Everything else stays in the high-precision dtype: embeddings and the patch convolution (not Linear), every norm
including the adaptive norms' time modulation (a small matmul whose error scales every activation of the expert),
the vision projector, the time MLP, the action input projection and the action output head (the velocity the
loss reads directly; a few thousand parameters, nothing to gain and precision to lose).

Backends:
- torchao: `convert_to_float8_training` with dynamic tensor-wise ("current") scaling; FSDP2 float8 all-gather
  is on, so parallel/ all-gathers the fp8 weights (and may call
  torchao.float8.precompute_float8_dynamic_scale_for_fsdp after each optimizer step). Runs on CPU too (tests).
  torchao has no delayed or 128x128 block scaling for training; those recipes need te.
- te: nn.Linear -> transformer_engine.pytorch.Linear (GPU only), and the forward must run inside
  `fp8_autocast(precision_cfg)` (te.autocast with the recipe: current, delayed or block scaling).
"""

from __future__ import annotations

import contextlib
import re

import torch
from torch import nn

from embodyhpc.errors import ConfigError

_BLOCK_LINEAR = re.compile(r"^(vision\.blocks|layers)\.\d+\.")
_ALIGNMENT = 16


def fp8_linear_filter(module: nn.Module, fqn: str) -> bool:
    """True for the Linear layers that run in fp8 (the rule in the module doc); fqn as from named_modules()."""
    if not isinstance(module, nn.Linear) or not _BLOCK_LINEAR.match(fqn) or "norm" in fqn:
        return False
    return module.in_features % _ALIGNMENT == 0 and module.out_features % _ALIGNMENT == 0


def convert_to_fp8(model: nn.Module, precision_cfg) -> nn.Module:
    """Swap the filtered Linear layers in place for the configured backend; returns the model."""
    if precision_cfg.fp8_backend == "torchao":
        return _convert_torchao(model, precision_cfg.fp8_recipe)
    return _convert_te(model)


def _convert_torchao(model: nn.Module, recipe: str) -> nn.Module:
    if recipe != "current":
        raise ConfigError(f"fp8_recipe={recipe} is not available with torchao (it trains with dynamic "
                          "tensor-wise scaling only)", key="precision.fp8_recipe",
                          fix="set precision.fp8_recipe=current, or precision.fp8_backend=te on GPUs")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ConfigError("precision.fp8_backend=torchao needs the torchao package", key="precision.fp8_backend",
                          fix="pip install torchao (0.18 with torch 2.13)") from exc
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=fp8_linear_filter)


def _import_te():
    try:
        import transformer_engine.pytorch as te
    except ImportError as exc:
        raise ConfigError("precision.fp8_backend=te needs transformer-engine (NVIDIA GPUs only)",
                          key="precision.fp8_backend",
                          fix="pip install 'transformer-engine[pytorch]' on the GPU nodes, or use "
                          "fp8_backend=torchao") from exc
    return te


def _convert_te(model: nn.Module) -> nn.Module:
    te = _import_te()
    targets = [(fqn, module) for fqn, module in model.named_modules() if fp8_linear_filter(module, fqn)]
    for fqn, linear in targets:
        parent_name, _, child_name = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        weight = linear.weight
        replacement = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                params_dtype=weight.dtype, device=weight.device)
        if weight.device.type != "meta":
            with torch.no_grad():
                replacement.weight.copy_(weight)
                if linear.bias is not None:
                    replacement.bias.copy_(linear.bias)
        setattr(parent, child_name, replacement)
    return model


def te_recipe(name: str):
    """The transformer-engine scaling recipe for precision.fp8_recipe."""
    from transformer_engine.common import recipe

    recipes = {"current": recipe.Float8CurrentScaling, "delayed": recipe.DelayedScaling,
               "block": recipe.Float8BlockScaling}
    return recipes[name]()


def fp8_autocast(precision_cfg):
    """The context the training forward runs in: te.autocast for fp8 with te, nothing otherwise (torchao's
    Float8Linear scales by itself)."""
    if precision_cfg is None or precision_cfg.mode != "fp8" or precision_cfg.fp8_backend != "te":
        return contextlib.nullcontext()
    return _import_te().autocast(enabled=True, recipe=te_recipe(precision_cfg.fp8_recipe))


def count_fp8_linears(model: nn.Module) -> tuple[int, int]:
    """(Linear layers converted to fp8, Linear layers left in high precision), for logs and tests."""
    converted = kept = 0
    for module in model.modules():
        name = type(module).__name__
        if name == "Float8Linear" or (name == "Linear" and type(module).__module__.startswith("transformer_engine")):
            converted += 1
        elif isinstance(module, nn.Linear):
            kept += 1
    return converted, kept
