"""Rotary position embeddings shared by the model families (Gemma's and Qwen's rotate the same way: the first half
of each head's features paired with the second half)."""

from __future__ import annotations

import torch


def rope_angles(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [R, T, 1, head_dim / 2] for integer positions [R, T] (float32; no buffers, so meta builds work)."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    return angles.cos()[:, :, None], angles.sin()[:, :, None]


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate [R, T, H, D] by position: (first half, second half) pairs, computed in float32."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)
