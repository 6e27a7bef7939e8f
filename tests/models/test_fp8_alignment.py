"""Every model plug-in feeds its fp8 layers token-aligned inputs, on its smoke batch and on random packed batches.

A float8 GEMM refuses misaligned operands on a GPU: transformer-engine asserts before each one that the product of
the input's leading dims is a multiple of 8 and its last dim a multiple of 16 (utils.assert_dim_for_fp8_exec), and
the CUDA `_scaled_mm` torchao calls needs the token count divisible by 16 in the weight-gradient GEMM (a check torch
skips on CPU). So the rule checked here, on the input of every layer `fp8_filter_for(model)` selects:

    prod(input.shape[:-1]) % 16 == 0   and   input.shape[-1] % 16 == 0

The models run unconverted (fp32, no fp8 library needed): the filter names the layers a conversion would swap, and a
forward pre-hook on each records what reaches it. Batches come from the plug-in's own collate on LeRobot-style items
(models/spec.py), packed as training packs them, including hostile ones: one sample, empty instructions, lengths
that are already aligned.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from embodyhpc.models import available_models, build_model, build_tokenizer, model_spec
from embodyhpc.models.fp8 import fp8_filter_for

ALIGNMENT = 16
WORDS = "pick up the red cup then open the top drawer and push the green block to the left edge".split()


def smoke_entry(name: str):
    spec = model_spec(name)
    if spec.smoke is None:
        pytest.skip(f"the {name} plug-in has no smoke entry: no model config to build it from")
    return spec.load("smoke")


def record_fp8_inputs(model: torch.nn.Module) -> tuple[list[tuple[str, tuple[int, ...]]], list]:
    """(the (layer, input shape) list the hooks fill, the hook handles)."""
    keep = fp8_filter_for(model)
    seen: list[tuple[str, tuple[int, ...]]] = []
    handles = []
    for fqn, module in model.named_modules():
        if keep(module, fqn):
            handles.append(module.register_forward_pre_hook(
                lambda _module, args, fqn=fqn: seen.append((fqn, tuple(args[0].shape)))))
    return seen, handles


def misaligned(seen: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    return [(fqn, shape) for fqn, shape in seen
            if math.prod(shape[:-1]) % ALIGNMENT or shape[-1] % ALIGNMENT]


def item(cameras: int, words: int, horizon: int, action_dims: int, g: torch.Generator, size: int = 40) -> dict:
    """A LeRobot-style dataset item (the collate input every plug-in takes, models/spec.py)."""
    out = {f"observation.images.cam{c}": torch.rand(3, size, size, generator=g) for c in range(cameras)}
    return out | {"observation.state": torch.rand(6, generator=g) * 2 - 1,
                  "action": torch.randn(horizon, action_dims, generator=g),
                  "action_is_pad": torch.zeros(horizon, dtype=torch.bool),
                  "task": " ".join(WORDS[:words])}


def random_batches(model_cfg, seed: int) -> list:
    """Packed batches of the plug-in's collate: random sizes and instruction lengths, plus the hostile cases."""
    spec = model_spec(model_cfg.name)
    collate = spec.load("collate")(dataclasses.replace(model_cfg, packing=True), build_tokenizer(model_cfg), None)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    horizon, dims = model_cfg.action_horizon, model_cfg.action_dim

    def batch(cameras: int, word_counts: list[int]):
        return collate([item(cameras, n, horizon, rng.randint(1, dims), g) for n in word_counts])

    batches = [batch(rng.randint(1, 2), [rng.randint(0, len(WORDS)) for _ in range(rng.randint(2, 7))])
               for _ in range(3)]
    batches.append(batch(1, [0]))  # one sample, empty instruction
    batches.append(batch(2, [len(WORDS)]))  # one sample, the longest instruction
    batches.append(batch(1, [0] * 16))  # sixteen equal samples (counts already aligned at most sizes)
    return batches


def run(model, batch, noise=None, flow_time=None) -> None:
    with torch.no_grad():
        if noise is None:
            model(batch, generator=torch.Generator().manual_seed(0))
        else:
            model(batch, noise=noise, time=flow_time)
        if hasattr(model, "sample_actions"):  # evaluation during training runs the fp8 layers too
            model.sample_actions(batch, num_steps=1)


@pytest.mark.parametrize("name", available_models())
def test_fp8_layers_see_aligned_tokens_on_the_smoke_batch(name: str) -> None:
    smoke = smoke_entry(name)
    model_cfg = smoke.config(smoke.sizes[0], "sdpa_reference")
    torch.manual_seed(0)
    model = build_model(model_cfg)
    seen, _ = record_fp8_inputs(model)
    for rank in (0, 1):
        batch, noise, flow_time, _tokens = smoke.fixed_batch(model_cfg, rank)
        run(model, batch, noise, flow_time)
    assert seen, f"no layer of {name} is selected for fp8: the rule checks nothing"
    assert misaligned(seen) == [], f"{name}: fp8 layers get inputs off the alignment of {ALIGNMENT}"


@pytest.mark.parametrize("name", available_models())
def test_fp8_layers_see_aligned_tokens_on_random_packed_batches(name: str) -> None:
    smoke = smoke_entry(name)
    model_cfg = smoke.config(smoke.sizes[0], "sdpa_reference")
    torch.manual_seed(0)
    model = build_model(model_cfg)
    seen, _ = record_fp8_inputs(model)
    for batch in random_batches(model_cfg, seed=7):
        run(model, batch)
    assert seen
    bad = misaligned(seen)
    assert bad == [], f"{name}: {len(bad)} fp8 inputs off the alignment of {ALIGNMENT}, e.g. {bad[:3]}"


SHIPPED = ("groot", "pi05")


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_models_filter_leaves_block_linears_with_unaligned_dims_in_high_precision(name: str) -> None:
    """The dims rule of `fp8_filter_for`, through the filter each shipped model gets (its FSDP units, not the
    fallback name rule): every Linear the filter selects is swapped for one whose in or out features are a multiple
    of 8 but not of 16 (the rest unchanged), and the filter takes none of them."""
    assert name in available_models()
    smoke = smoke_entry(name)
    model = build_model(smoke.config(smoke.sizes[0], "sdpa_reference"))
    assert callable(getattr(model, "fsdp_units", None)), f"{name} declares no FSDP units: the fallback filter runs"
    keep = fp8_filter_for(model)
    selected = [(fqn, module) for fqn, module in model.named_modules() if keep(module, fqn)]
    assert len(selected) >= 10 and all(
        m.in_features % ALIGNMENT == 0 and m.out_features % ALIGNMENT == 0 for _, m in selected)
    for index, (fqn, linear) in enumerate(selected):
        grow_in = index % 2 == 0
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, torch.nn.Linear(
            linear.in_features + (ALIGNMENT // 2 if grow_in else 0),
            linear.out_features + (0 if grow_in else ALIGNMENT // 2)))
    keep = fp8_filter_for(model)  # what convert_te and torchao's conversion ask, layer by layer
    assert [fqn for fqn, _ in selected if keep(model.get_submodule(fqn), fqn)] == []
