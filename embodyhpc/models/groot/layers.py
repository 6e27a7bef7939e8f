"""Building blocks of the GR00T action head: category-specific (per-embodiment) layers, timestep features, the
adaptive LayerNorm, and the transformer block shared by the VL adapter and the DiT.

Module and parameter names follow the published checkpoint's where the function is the same (to_q/to_k/to_v/
to_out.0, ff.net.0.proj/ff.net.2, norm1/norm3, layer1/layer2 with W/b), so that weights.py maps the action head
one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from embodyhpc.models.attention import PreparedAttention, attend


class CategorySpecificLinear(nn.Module):
    """A Linear per category (embodiment): y = x @ W[c] + b[c]; W [C, in, out], b [C, out]."""

    def __init__(self, num_categories: int, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.empty(num_categories, in_dim, out_dim))
        self.b = nn.Parameter(torch.empty(num_categories, out_dim))

    def forward(self, x: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        """x [N, T, in], category [N] int64 -> [N, T, out]."""
        weight, bias = self.W[category], self.b[category]  # [N, in, out], [N, out]
        return torch.bmm(x.to(weight.dtype), weight) + bias[:, None, :]


class CategorySpecificMLP(nn.Module):
    def __init__(self, num_categories: int, in_dim: int, hidden: int, out_dim: int) -> None:
        super().__init__()
        self.layer1 = CategorySpecificLinear(num_categories, in_dim, hidden)
        self.layer2 = CategorySpecificLinear(num_categories, hidden, out_dim)

    def forward(self, x: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        return self.layer2(F.relu(self.layer1(x, category)), category)


def sinusoid(values: torch.Tensor, dim: int, *, shift: float = 0.0, cos_first: bool = False) -> torch.Tensor:
    """[...] -> [..., dim] features sin(v * f_i) | cos(v * f_i), f_i = 10000 ** (-i / (dim / 2 - shift))."""
    half = dim // 2
    exponent = -math.log(10_000.0) * torch.arange(half, dtype=torch.float32, device=values.device) / (half - shift)
    angles = values.float()[..., None] * torch.exp(exponent)
    parts = [angles.cos(), angles.sin()] if cos_first else [angles.sin(), angles.cos()]
    return torch.cat(parts, dim=-1)


class ActionEncoder(nn.Module):
    """Noisy actions and their timestep -> action tokens, per embodiment: W3(swish(W2([W1(a) | sin(t)])))."""

    def __init__(self, num_categories: int, action_dim: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.W1 = CategorySpecificLinear(num_categories, action_dim, width)
        self.W2 = CategorySpecificLinear(num_categories, 2 * width, width)
        self.W3 = CategorySpecificLinear(num_categories, width, width)

    def forward(self, actions: torch.Tensor, timestep: torch.Tensor, category: torch.Tensor) -> torch.Tensor:
        """actions [N, H, A], timestep [N] (bucketed, 0..1000) -> [N, H, width]."""
        a = self.W1(actions, category)
        tau = sinusoid(timestep[:, None].expand(-1, actions.shape[1]), self.width).to(a.dtype)
        x = F.silu(self.W2(torch.cat([a, tau], dim=-1), category))
        return self.W3(x, category)


class TimestepEmbedder(nn.Module):
    def __init__(self, in_dim: int, width: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, width)
        self.linear_2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class TimestepEncoder(nn.Module):
    """Bucketed timestep [N] -> [N, width]: 256 sinusoidal features (cos | sin, frequency shift 1), then an MLP."""

    def __init__(self, feature_dim: int, width: int) -> None:
        super().__init__()
        self.feature_dim = feature_dim
        self.timestep_embedder = TimestepEmbedder(feature_dim, width)

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        features = sinusoid(timestep, self.feature_dim, shift=1.0, cos_first=True)
        return self.timestep_embedder(features.to(self.timestep_embedder.linear_1.weight.dtype))


class AdaLayerNorm(nn.Module):
    """LayerNorm without affine, scaled and shifted per sample by the timestep embedding:
    x_hat * (1 + scale) + shift, with [scale | shift] = linear(silu(temb))."""

    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.linear = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        """x [N, S, D], temb [N, D]."""
        scale, shift = self.linear(F.silu(temb)).float().chunk(2, dim=-1)
        normed = F.layer_norm(x.float(), x.shape[-1:], eps=self.eps)
        return (normed * (1.0 + scale[:, None]) + shift[:, None]).type_as(x)


class Attention(nn.Module):
    """Multi-head attention projections (query width -> heads x head_dim, keys/values from `context_dim`)."""

    def __init__(self, width: int, heads: int, head_dim: int, context_dim: int | None = None,
                 dropout: float = 0.0) -> None:
        super().__init__()
        inner, context_dim = heads * head_dim, context_dim or width
        self.heads, self.head_dim = heads, head_dim
        self.to_q = nn.Linear(width, inner)
        self.to_k = nn.Linear(context_dim, inner)
        self.to_v = nn.Linear(context_dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, width), nn.Dropout(dropout)])

    def split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.head_dim))

    def out(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_out[1](self.to_out[0](x.flatten(-2)))


class GeluProjection(nn.Module):
    def __init__(self, width: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x), approximate="tanh")


class FeedForward(nn.Module):
    def __init__(self, width: int, inner: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(width, inner), nn.Dropout(dropout), nn.Linear(inner, width),
                                  nn.Dropout(dropout)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class VLBlock(nn.Module):
    """A pre-LN self-attention block of the VL adapter, over the VLM tokens in rows; attention stays within each
    sample (segment) through the attention backend seam."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-5)
        self.attn1 = Attention(width, heads, width // heads, dropout=dropout)
        self.norm3 = nn.LayerNorm(width, eps=1e-5)
        self.ff = FeedForward(width, 4 * width, dropout)

    def forward(self, x: torch.Tensor, prepared: PreparedAttention) -> torch.Tensor:
        """x [R, T, D] rows of VLM tokens."""
        h = self.norm1(x)
        a = self.attn1
        out = attend(a.split(a.to_q(h)), a.split(a.to_k(h)), a.split(a.to_v(h)), prepared=prepared)
        x = x + a.out(out)
        return x + self.ff(self.norm3(x))


class DiTBlock(nn.Module):
    """One DiT block: adaptive LN on the timestep, then cross-attention from the action-side tokens to the VLM
    tokens (`cross=True`) or self-attention among the action-side tokens, then LN (no affine) and a GELU FFN."""

    def __init__(self, width: int, heads: int, context_dim: int, *, cross: bool, dropout: float) -> None:
        super().__init__()
        self.cross = cross
        self.norm1 = AdaLayerNorm(width)
        self.attn1 = Attention(width, heads, width // heads, context_dim if cross else None, dropout)
        self.norm3 = nn.LayerNorm(width, eps=1e-5, elementwise_affine=False)
        self.ff = FeedForward(width, 4 * width, dropout)

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: torch.Tensor, ctx) -> torch.Tensor:
        """x [N, S', D] action-side tokens (S real ones, then alignment tokens), temb [N, D], context [R, Tk, Dc]
        VLM rows; ctx: head.DiTContext."""
        a = self.attn1
        h = self.norm1(x, temb)
        q = a.split(a.to_q(h))  # [N, S', H, hd]
        if self.cross:  # the samples' queries gathered into the VLM rows: each attends to its own sample only
            q_rows = ctx.to_rows(q)
            out = attend(q_rows, a.split(a.to_k(context)), a.split(a.to_v(context)), prepared=ctx.cross)
            out = ctx.from_rows(out, x.shape[:2])
        else:  # among a sample's S real tokens; the alignment tokens get zeros
            real = ctx.num_tokens
            k, v = a.split(a.to_k(h)), a.split(a.to_v(h))
            out = F.scaled_dot_product_attention(q[:, :real].transpose(1, 2), k[:, :real].transpose(1, 2),
                                                 v[:, :real].transpose(1, 2))
            out = F.pad(out.transpose(1, 2), (0, 0, 0, 0, 0, x.shape[1] - real))
        x = x + a.out(out)
        return x + self.ff(self.norm3(x))
