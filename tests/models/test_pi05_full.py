"""The published pi0/pi0.5 shapes, built on the meta device (no memory): parameter counts per part."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model
from embodyhpc.models.pi05 import SHAPES, Pi05Policy


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def parts(model: Pi05Policy) -> dict[str, int]:
    split = {
        "vision tower (SigLIP So400m/14)": count(model.vision),
        "token embedding": count(model.embed_tokens),
        "VLM decoder blocks (Gemma 2B)": sum(count(layer.vlm) for layer in model.layers),
        "action expert blocks (Gemma 300M + adaRMS)": sum(count(layer.expert) for layer in model.layers),
    }
    split["rest (projector, time MLP, action in/out, final norm)"] = count(model) - sum(split.values())
    return split


def test_full_size_parameter_count(capsys) -> None:
    with torch.device("meta"):
        model = build_model(ModelConfig(size="full", action_horizon=50, action_dim=32))
    total, split = count(model), parts(model)
    with capsys.disabled():
        print(f"\npi05 full: {total:,} parameters")
        for name, value in split.items():
            print(f"  {name:<55} {value:>15,}")
    assert all(p.is_meta for p in model.parameters())
    assert 3.2e9 < total < 3.45e9  # published: ~3.3B
    assert 0.40e9 < split["vision tower (SigLIP So400m/14)"] < 0.43e9  # So400m: ~400M
    # the last layer's VLM q/o projections, MLP and MLP norm are not built: the prefix only gives keys/values there
    not_built = 2 * (8 * 256) * 2048 + 3 * 2048 * 16_384 + 2048
    gemma_2b = split["token embedding"] + split["VLM decoder blocks (Gemma 2B)"] + not_built
    assert 2.45e9 < gemma_2b < 2.55e9  # Gemma 2B: 2.51B with its 257152-id embedding
    # Gemma 300M (~0.31B) + adaRMS: 2 norms x 18 layers x (1024 -> 3 x 1024: scale, shift, gate) ~0.11B
    assert 0.40e9 < split["action expert blocks (Gemma 300M + adaRMS)"] < 0.45e9
    assert split["token embedding"] == 257_152 * 2048


@pytest.mark.parametrize(("size", "low", "high"), [("tiny", 2e5, 2e6), ("small", 1e8, 3e8)])
def test_smaller_sizes(size: str, low: float, high: float) -> None:
    with torch.device("meta"):
        model = build_model(ModelConfig(size=size))
    assert low < count(model) < high
    shape = SHAPES[size]
    assert len(model.layers) == shape.depth and len(model.vision.blocks) == shape.vision.depth
