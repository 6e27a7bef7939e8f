"""Shared by the GR00T benches: a "bench" shape (bigger than tiny so that matmuls, not Python, dominate) and
skewed batches. Not a bench itself."""

from __future__ import annotations

import torch

from embodyhpc.models.groot.batch import GrootSample, collate
from embodyhpc.models.groot.model import GrootPolicy
from embodyhpc.models.groot.shapes import SHAPES, GrootShape, HeadShape, LlmShape
from embodyhpc.models.shapes import VisionShape

NUM_CAMERAS, ACTION_DIM, HORIZON = 2, 8, 16
BENCH = GrootShape(
    vision=VisionShape(image_size=64, patch_size=8, width=128, depth=2, num_heads=4, mlp_dim=512),
    llm=LlmShape(width=256, depth=2, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=768, vocab_size=320),
    head=HeadShape(vl_heads=4, vl_depth=1, dit_width=192, dit_heads=4, dit_depth=4, hidden=128, max_state_dim=64,
                   num_future_tokens=8, num_embodiments=32, max_seq_len=64))


def build(size: str, seed: int = 0) -> GrootPolicy:
    torch.manual_seed(seed)
    shape = BENCH if size == "bench" else SHAPES[size]
    return GrootPolicy(shape, action_horizon=HORIZON, action_dim=ACTION_DIM)


def skewed_batch(model: GrootPolicy, num_samples: int, seed: int, *, with_actions: bool = True):
    """Instructions of 5-30 tokens (70 %), 40-120 (25 %) or 200-300 (5 %); 2 cameras each."""
    g = torch.Generator().manual_seed(seed)
    size = model.shape.vision.image_size
    samples = []
    for _ in range(num_samples):
        draw = float(torch.rand(1, generator=g))
        low, high = (5, 30) if draw < 0.7 else (40, 120) if draw < 0.95 else (200, 300)
        length = int(torch.randint(low, high + 1, (1,), generator=g))
        samples.append(GrootSample(
            images=torch.rand(NUM_CAMERAS, 3, size, size, generator=g),
            text_ids=torch.randint(3, 259, (length,), generator=g).tolist(), state=torch.randn(40, generator=g),
            actions=torch.randn(HORIZON, ACTION_DIM, generator=g) if with_actions else None))
    return collate(samples, embodiment_id=31)
