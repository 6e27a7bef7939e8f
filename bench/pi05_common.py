"""Shared by the pi0.5 step-time benches (ema_cost.py, lora_cost.py): the tiny model's sizes and random micro-batches
(2 cameras, a random instruction of four, a 6-d state, an 8 x 8 action chunk). Not a bench itself."""

from __future__ import annotations

import torch

NUM_CAMERAS, ACTION_DIM, HORIZON = 2, 8, 8
INSTRUCTIONS = ("pick up the cup", "open the top drawer", "push the red block to the left edge", "close it")


def pi05_batches(cfg, count: int, micro_batch: int) -> list:
    """`count` collated micro-batches for the model config `cfg`, the same for every caller (seed 0)."""
    from embodyhpc.models import build_tokenizer
    from embodyhpc.models.pi05 import Pi05Sample, collate, max_prompt_tokens

    tokenizer, max_prompt = build_tokenizer(cfg), max_prompt_tokens(cfg, NUM_CAMERAS)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        samples = [Pi05Sample(images=torch.rand(NUM_CAMERAS, 3, 32, 32, generator=g),
                              instruction=INSTRUCTIONS[int(torch.randint(len(INSTRUCTIONS), (1,), generator=g))],
                              state=torch.rand(6, generator=g) * 2 - 1,
                              actions=torch.randn(HORIZON, ACTION_DIM, generator=g)) for _ in range(micro_batch)]
        out.append(collate(samples, tokenizer, max_prompt_tokens=max_prompt))
    return out
