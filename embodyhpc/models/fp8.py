"""`precision.mode: fp8`: matmuls of the transformer blocks in float8, everything else in high precision.

Which layers go to fp8 (`fp8_filter_for(model)`, one rule for both backends and every model plug-in):
  an nn.Linear inside one of the model's declared FSDP units (`fsdp_units()`: its repeated blocks; for pi0.5
  vision.blocks.*, layers.* — attention projections and MLPs of the VLM and the action expert; for GR00T also the
  VL adapter's and the DiT's blocks), not in a norm, whose in and out features are both multiples of 16 (float8
  GEMMs need that alignment), and that is trainable (a parameter requires grad). `fp8_linear_filter` is the same
  block rule spelled with pi0.5's block names.
A frozen Linear stays in high precision: there is no backward through its weights to speed up, and float8 would
shift the features a pretrained part was trained to give (GR00T's LLM and vision tower, frozen unless
model.options.tune_llm / tune_visual). Models set requires_grad in their constructor, so the filter sees it when
build_model converts.
Everything else stays in the high-precision dtype: embeddings and the patch convolution (not Linear), every norm
including the adaptive norms' time modulation (a small matmul whose error scales every activation of the expert),
the vision projector, the time MLP, the action input projection and the action output head (the velocity the
loss reads directly; a few thousand parameters, nothing to gain and precision to lose).

Backends:
- torchao: `convert_to_float8_training` with dynamic tensor-wise ("current") scaling; FSDP2 float8 all-gather
  is on, so parallel/ all-gathers the fp8 weights (and may call
  torchao.float8.precompute_float8_dynamic_scale_for_fsdp after each optimizer step). Runs on CPU too (tests).
  torchao has no delayed or 128x128 block scaling for training; those recipes need te.
- te: nn.Linear -> transformer_engine.pytorch.Linear (GPU only; 2.9-2.18, checked at import). A te.Linear runs in
  FP8 only inside te.autocast: the training loop runs every micro-batch's forward in `fp8_autocast(precision_cfg)`
  (the recipe: current, delayed or block scaling), and activation checkpointing recomputes through TE's own
  checkpoint (`checkpoint_fn`), which re-enters that context. Meta-device builds stay on meta (the device goes to TE
  as a string) and are filled by the model's init rules like every other layer.
Each step logs `fp8_gemms` (forward GEMMs that ran in float8, FP8GemmCounter) and `fp8_gemms_fell_back` (te
layers that ran outside autocast), so a run shows whether FP8 is on. Tested on CPU through the transformer-engine
double in tests/doubles.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable

import torch
from torch import nn

from embodyhpc.errors import ConfigError

_BLOCK_LINEAR = re.compile(r"^(vision\.blocks|layers)\.\d+\.")
_ALIGNMENT = 16


def _aligned(module: nn.Linear) -> bool:
    """Both dims multiples of 16: what float8 GEMMs accept (module doc); the one check of both filters."""
    return module.in_features % _ALIGNMENT == 0 and module.out_features % _ALIGNMENT == 0


def fp8_linear_filter(module: nn.Module, fqn: str) -> bool:
    """True for the Linear layers that run in fp8 (the rule in the module doc); fqn as from named_modules()."""
    if not isinstance(module, nn.Linear) or not _BLOCK_LINEAR.match(fqn) or "norm" in fqn:
        return False
    return _aligned(module)


def fp8_filter_for(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """The filter of `model` (module doc): trainable Linear layers inside its declared FSDP units; a model declaring
    none gets pi0.5's name rule. Frozen layers (no parameter requires grad) are never selected."""
    declare = getattr(model, "fsdp_units", None)
    if declare is None:
        in_block = fp8_linear_filter
    else:
        units = {id(unit) for unit in declare()}
        prefixes = tuple(f"{name}." for name, module in model.named_modules() if id(module) in units)

        def in_block(module: nn.Module, fqn: str) -> bool:
            if not isinstance(module, nn.Linear) or not fqn.startswith(prefixes) or "norm" in fqn:
                return False
            return _aligned(module)

    def trainable_in_block(module: nn.Module, fqn: str) -> bool:
        return in_block(module, fqn) and any(p.requires_grad for p in module.parameters())

    return trainable_in_block


def convert_to_fp8(model: nn.Module, precision_cfg) -> nn.Module:
    """Swap the filtered Linear layers in place for the configured backend; returns the model."""
    if precision_cfg.fp8_backend == "torchao":
        return _convert_torchao(model, precision_cfg.fp8_recipe)
    return convert_te(model)


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
    return convert_to_float8_training(model, config=config, module_filter_fn=fp8_filter_for(model))


TE_MIN_VERSION = (2, 9)
"""te.autocast(recipe=...) and transformer_engine.pytorch.quantization exist from 2.9 (fp8_autocast before, with
fp8_recipe=); Float8CurrentScaling came in 2.2 and Float8BlockScaling in 2.3. pyproject's `gpu` extra pins the
range read (2.9-2.18); this check gives an install outside it a one-line error instead of an AttributeError."""


def import_te():
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
    except ImportError as exc:
        raise ConfigError("precision.fp8_backend=te needs transformer-engine (NVIDIA GPUs only)",
                          key="precision.fp8_backend",
                          fix="pip install 'transformer-engine[pytorch]>=2.9' on the GPU nodes, or use "
                          "fp8_backend=torchao") from exc
    version = str(getattr(transformer_engine, "__version__", "0"))
    if _version_tuple(version) < TE_MIN_VERSION or not hasattr(te, "autocast"):
        raise ConfigError(f"transformer-engine {version} is too old: embodyhpc uses te.autocast(recipe=...) from 2.9",
                          key="precision.fp8_backend",
                          fix="pip install 'transformer-engine[pytorch]>=2.9,<2.19' on the GPU nodes")
    return te


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = re.match(r"\d+", piece)
        parts.append(int(digits.group()) if digits else 0)
    return tuple(parts)


def convert_te(model: nn.Module) -> nn.Module:
    """Swap the filtered nn.Linear layers for te.Linear with the same shapes, dtype and device.

    TE decides whether to defer initialisation with `device == "meta"`, a comparison with the string: a
    torch.device("meta") is not equal to it, and TE would then allocate and initialise the full weight on cuda on
    every rank at build time. So the device goes in as its string. A meta build stays on meta (materialize fills
    it by the model's init rules, which cover te.Linear); a real build copies the Linear's values.
    """
    te = import_te()
    keep = fp8_filter_for(model)
    targets = [(fqn, module) for fqn, module in model.named_modules() if keep(module, fqn)]
    for fqn, linear in targets:
        parent_name, _, child_name = fqn.rpartition(".")
        parent = model.get_submodule(parent_name)
        weight = linear.weight
        replacement = te.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                params_dtype=weight.dtype, device=str(weight.device))
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


def uses_te(precision_cfg) -> bool:
    return precision_cfg is not None and precision_cfg.mode == "fp8" and precision_cfg.fp8_backend == "te"


def fp8_autocast(precision_cfg, amax_reduction_group=None):
    """The context every training forward (each micro-batch) runs in: te.autocast with the recipe for fp8 with te,
    nothing otherwise (torchao's Float8Linear scales by itself). `amax_reduction_group`: the data-parallel group
    over which delayed scaling reduces its amaxes (the loop passes the default group)."""
    if not uses_te(precision_cfg):
        return contextlib.nullcontext()
    return import_te().autocast(enabled=True, recipe=te_recipe(precision_cfg.fp8_recipe),
                                 amax_reduction_group=amax_reduction_group)


def checkpoint_fn(precision_cfg):
    """The activation-checkpoint function for blocks (parallel/ac.py): transformer-engine's own
    te.distributed.checkpoint for fp8 with te, whose recompute re-enters the FP8 context of the forward (torch's
    checkpoint would recompute TE layers outside autocast, in bf16, against activations saved in fp8); None (torch's)
    otherwise."""
    return import_te().distributed.checkpoint if uses_te(precision_cfg) else None


def is_fp8_layer(module: nn.Module) -> bool:
    name, where = type(module).__name__, type(module).__module__
    return (name == "Float8Linear" and where.startswith("torchao")) or (
        name == "Linear" and where.startswith("transformer_engine"))


def count_fp8_linears(model: nn.Module) -> tuple[int, int]:
    """(Linear layers converted to fp8, Linear layers left in high precision), for logs and tests."""
    converted = kept = 0
    for module in model.modules():
        if is_fp8_layer(module):
            converted += 1
        elif isinstance(module, nn.Linear):
            kept += 1
    return converted, kept


class FP8GemmCounter:
    """Counts, per step, the forward GEMMs of the model's fp8 layers that ran in float8, and those that did not.

    A forward pre-hook on each fp8 layer adds 1 to one of two counters: torchao's Float8Linear always computes in
    float8; a te.Linear does only inside te.autocast (FP8GlobalStateManager.is_fp8_enabled(), read when the layer is
    called), and otherwise falls back to the parameters' precision, which is what `fell_back` catches. Recomputation
    under activation checkpointing counts (those GEMMs run again); each forward GEMM also has two backward GEMMs
    (input and weight gradients) in the same precision, which are not counted.

    The counters are tensors on the model's device, added to in place, so the hooks trace into compiled blocks
    without graph breaks or recompiles; `take()` reads and resets them (one host sync, at log steps).
    """

    def __init__(self, model: nn.Module, device: torch.device | str) -> None:
        self.fp8 = torch.zeros((), dtype=torch.int64, device=device)
        self.fell_back = torch.zeros((), dtype=torch.int64, device=device)
        self.num_layers = 0
        self._handles = []
        for module in model.modules():
            if is_fp8_layer(module):
                hook = self._te_hook if type(module).__module__.startswith("transformer_engine") else self._hook
                self._handles.append(module.register_forward_pre_hook(hook))
                self.num_layers += 1

    def _hook(self, module: nn.Module, args) -> None:
        self.fp8.add_(1)

    def _te_hook(self, module: nn.Module, args) -> None:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        (self.fp8 if FP8GlobalStateManager.is_fp8_enabled() else self.fell_back).add_(1)

    def take(self) -> tuple[int, int]:
        """(fp8 GEMMs, GEMMs of fp8 layers that ran in high precision) since the last take, and reset."""
        values = (int(self.fp8), int(self.fell_back))
        self.fp8.zero_()
        self.fell_back.zero_()
        return values

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
