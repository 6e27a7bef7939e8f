"""The RMSNorm variants of the model families, normalising in float32 (bf16 loses the small activations that
matter here) and returning the input's dtype:
- RMSNorm (Qwen, GR00T-N1.5's LLM): x / rms(x) * weight, the weight itself, initialised to 1;
- OffsetRMSNorm (Gemma, pi0.5's streams): x / rms(x) * (1 + weight), the scale stored as an offset from 1,
  initialised to 0.
They are distinct classes because their init rules differ (each family's `init_rules` picks them by type).
Adaptive variants whose scale comes from a condition build on `rms_normalize`.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x ** 2) + eps) over the last dim, in float32."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Qwen's RMSNorm: x / rms(x) * weight (the weight itself, initialised to 1)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * self.weight.float()).type_as(x)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: the learned scale is stored as an offset from 1 (zero-initialised)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_normalize(x, self.eps) * (1.0 + self.weight.float())).type_as(x)
