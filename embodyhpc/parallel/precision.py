"""FSDP2 mixed precision from the recipe's `precision` section, and the fp8 pieces that need distributed code.

Parameters are stored (sharded) in float32 whatever the mode, so the optimizer steps in float32:
- fp32: no casts; gradients reduced in float32.
- bf16: parameters all-gathered and used in bfloat16 (half the all-gather bytes, bf16 matmuls); gradients
  reduce-scattered in float32, since summing many ranks' bf16 gradients loses the small ones.
- fp8: as bf16 for everything models/fp8.py left in high precision. With torchao the converted Linear weights
  are all-gathered in float8 (a quarter of float32's bytes): the conversion config sets
  enable_fsdp_float8_all_gather, so each sharded weight casts itself to float8 before FSDP's all-gather
  (fsdp_pre_all_gather on torchao's weight tensor subclass) and FSDP needs no extra option. With te the
  weights are all-gathered in bf16 and transformer-engine casts inside its layers.
FSDP's own casting of forward inputs is off (cast_forward_inputs=False, for units and root alike): with it, every
wrapped module's floating-point arguments are cast to the parameter dtype, and torch 2.13's `_apply_to_tensors`
recurses into dataclasses, rebuilding them with dataclasses.replace. That rounded pi0.5's flow-matching target
(Pi05Batch.actions) to bf16, and gave every layer a fresh copy of the token plan, whose cached attention layouts
were then rebuilt in every layer. Models cast what they compute on to their weights' dtype themselves (pi0.5 does),
and keep targets, rotary angles and plans as built.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from embodyhpc.config.schema import PrecisionConfig


def mixed_precision_policy(precision_cfg: PrecisionConfig) -> MixedPrecisionPolicy:
    """The MixedPrecisionPolicy for every fully_shard call (units and root alike)."""
    if precision_cfg.mode == "fp32":
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def fp8_backend_in_model(model: nn.Module) -> str:
    """Which fp8 layers the model holds: "torchao", "te" or "off" (none), judged by the layers, not the recipe."""
    for module in model.modules():
        kind = type(module)
        if kind.__name__ == "Float8Linear" and kind.__module__.startswith("torchao"):
            return "torchao"
        if kind.__module__.startswith("transformer_engine"):
            return "te"
    return "off"


def check_fp8_conversion(model: nn.Module, precision_cfg: PrecisionConfig) -> str:
    """The model's fp8 backend; refuses precision.mode=fp8 on a model that was not converted (it would silently
    train in bf16) and a torchao conversion without float8 all-gather (it would all-gather bf16 weights)."""
    backend = fp8_backend_in_model(model)
    if precision_cfg.mode != "fp8":
        return backend
    if backend != precision_cfg.fp8_backend:
        raise ValueError(f"precision.mode=fp8 with fp8_backend={precision_cfg.fp8_backend}, but the model holds "
                         f"{'no fp8 layers' if backend == 'off' else backend + ' layers'}: build it with "
                         "embodyhpc.models.build_model(model_cfg, precision_cfg) before parallelize()")
    if backend == "torchao":
        without = [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"
                   and not module.config.enable_fsdp_float8_all_gather]
        if without:
            raise ValueError(f"{len(without)} Float8Linear layers (first: {without[0]}) were converted without "
                             "enable_fsdp_float8_all_gather; convert with embodyhpc.models.fp8.convert_to_fp8")
    return backend


@torch.no_grad()
def precompute_fp8_scales(model: nn.Module) -> None:
    """Optional, torchao fp8 only: compute the float8 scales of all sharded fp8 weights in one all-reduce.

    Without it every fp8 weight all-reduces its own amax inside its all-gather (correct, one small collective
    per weight). Once called, it must be called after EVERY optimizer step and after loading a checkpoint: the
    scale is cached on the weight and a stale one would clip or waste the float8 range. A no-op for models
    without torchao fp8 layers.
    """
    if fp8_backend_in_model(model) != "torchao":
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)
