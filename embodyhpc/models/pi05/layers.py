"""Building blocks of the pi0.5 streams: Gemma-style RMSNorm, adaptive RMSNorm, RoPE, GeGLU, the per-stream block
and the joint layer where the VLM stream and the action expert attend together."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from embodyhpc.models.attention import attend
from embodyhpc.models.pi05.plan import TokenPlan
from embodyhpc.models.pi05.shapes import Pi05Shape, StreamShape


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()  # the mean of squares in float32: bf16 loses the small activations that matter here
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: the learned scale is stored as an offset from 1 (zero-initialised)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_normalize(x, self.eps) * (1.0 + self.weight.float())).type_as(x)


@dataclass(frozen=True)
class TimeCondition:
    """The flow-matching time embedding per sample, and which sample each action-stream token belongs to."""

    per_sample: torch.Tensor  # [N, cond_dim]
    token_sample: torch.Tensor  # [R, Ta] int64 into per_sample; N (one past the end) for padding tokens


class AdaRMSNorm(nn.Module):
    """RMSNorm whose scale and shift come from the time embedding: x_hat * (1 + scale) + shift.

    The modulation is computed once per sample and gathered per token (cheaper than per token: a row packs
    several samples with different times). Zero-initialised, it starts as a plain RMSNorm; padding tokens get
    scale = shift = 0.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.modulation = nn.Linear(cond_dim, 2 * dim)

    def forward(self, x: torch.Tensor, cond: TimeCondition) -> torch.Tensor:
        per_sample = self.modulation(cond.per_sample)  # [N, 2 * dim]
        per_sample = torch.cat([per_sample, per_sample.new_zeros(1, per_sample.shape[1])])
        scale, shift = per_sample[cond.token_sample].float().chunk(2, dim=-1)  # [R, Ta, dim] each
        return (_rms_normalize(x, self.eps) * (1.0 + scale) + shift).type_as(x)


def rope_angles(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [R, T, 1, head_dim / 2] for integer positions [R, T] (float32; no buffers, so meta builds work)."""
    inv_freq = base ** -(torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    return angles.cos()[:, :, None], angles.sin()[:, :, None]


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate [R, T, H, D] by position: (first half, second half) pairs, as Gemma does."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


class GeGLU(nn.Module):
    def __init__(self, width: int, mlp_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, mlp_dim, bias=False)
        self.up_proj = nn.Linear(width, mlp_dim, bias=False)
        self.down_proj = nn.Linear(mlp_dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class StreamBlock(nn.Module):
    """One stream's weights in one layer: pre-norm attention projections (multi-query) and a GeGLU MLP.

    The attention itself happens in JointLayer, over both streams at once. With `cond_dim` the norms are adaptive
    (the action expert); without, plain RMSNorm (the VLM decoder).
    """

    def __init__(self, stream: StreamShape, shape: Pi05Shape, cond_dim: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim

        def norm() -> nn.Module:
            if cond_dim is None:
                return RMSNorm(stream.width, shape.norm_eps)
            return AdaRMSNorm(stream.width, cond_dim, shape.norm_eps)

        self.attn_norm = norm()
        self.q_proj = nn.Linear(stream.width, shape.num_heads * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(stream.width, shape.num_kv_heads * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(stream.width, shape.num_kv_heads * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * shape.head_dim, stream.width, bias=False)
        self.mlp_norm = norm()
        self.mlp = GeGLU(stream.width, stream.mlp_dim)

    def normed(self, norm: nn.Module, x: torch.Tensor, cond: TimeCondition | None) -> torch.Tensor:
        return norm(x) if cond is None else norm(x, cond)

    def keys_values(self, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        rows, length = h.shape[:2]
        k = self.k_proj(h).view(rows, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(rows, length, self.num_kv_heads, self.head_dim)
        return apply_rope(k, rope), v

    def queries(self, h: torch.Tensor, rope) -> torch.Tensor:
        return apply_rope(self.q_proj(h).view(*h.shape[:2], self.num_heads, self.head_dim), rope)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, cond: TimeCondition | None) -> torch.Tensor:
        """Residual updates after attention: x + o_proj(attn), then x + mlp(norm(x))."""
        x = x + self.o_proj(attn.flatten(2))
        return x + self.mlp(self.normed(self.mlp_norm, x, cond))


@dataclass(frozen=True)
class LayerContext:
    """What every layer of one pass shares: the token plan (layouts), rotary angles, time condition, backend."""

    plan: TokenPlan
    prefix_rope: tuple[torch.Tensor, torch.Tensor]
    suffix_rope: tuple[torch.Tensor, torch.Tensor]
    cond: TimeCondition | None
    backend: str


KeyValue = tuple[torch.Tensor, torch.Tensor]  # k, v [R, Tp, Hkv, D] of the prefix, rotary already applied


class JointLayer(nn.Module):
    """One depth of pi0.5: the VLM block over the prefix and the expert block over the action chunk, both
    producing q/k/v with their own weights, one attention over the concatenation (prefix first), outputs split
    back. This module is the FSDP unit: FSDP2 gathers parameters when a module's forward runs, and both blocks'
    weights are needed inside this one forward.

    Passes (what the caller gives -> what runs):
    - prefix and suffix, prefix_queries=True: training, all but the last layer (joint layout).
    - prefix and suffix, prefix_queries=False: training, last layer: nothing reads the prefix output after it,
      so the prefix contributes keys/values only (its q_proj, o_proj and MLP get no gradient there).
    - prefix only: filling the inference cache (prefix layout); prefix_queries=False returns only K/V.
    - suffix and cached_kv: an Euler step of inference over the cached prefix.
    Returns (prefix out or None, suffix out or None, the prefix's K/V or None).
    """

    def __init__(self, shape: Pi05Shape) -> None:
        super().__init__()
        self.vlm = StreamBlock(shape.vlm, shape)
        self.expert = StreamBlock(shape.expert, shape, cond_dim=shape.expert.width)
        self.scale = 1.0 / math.sqrt(shape.head_dim)

    def forward(self, prefix: torch.Tensor | None, suffix: torch.Tensor | None, *, ctx: LayerContext,
                cached_kv: KeyValue | None = None, prefix_queries: bool = True):
        queries, keys, values = [], [], []
        kv = cached_kv
        if prefix is not None:
            h = self.vlm.normed(self.vlm.attn_norm, prefix, None)
            kv = self.vlm.keys_values(h, ctx.prefix_rope)
            if prefix_queries:
                queries.append(self.vlm.queries(h, ctx.prefix_rope))
        if kv is None:
            raise ValueError("the suffix needs the prefix: pass prefix tokens or cached_kv")
        keys.append(kv[0])
        values.append(kv[1])
        if suffix is not None:
            h = self.expert.normed(self.expert.attn_norm, suffix, ctx.cond)
            queries.append(self.expert.queries(h, ctx.suffix_rope))
            k, v = self.expert.keys_values(h, ctx.suffix_rope)
            keys.append(k)
            values.append(v)
        if not queries:  # the last layer of the cache fill: later layers read nothing but these K/V
            return None, None, kv
        if suffix is None:
            layout = ctx.plan.prefix_layout
        elif prefix is not None and prefix_queries:
            layout = ctx.plan.joint_layout
        else:
            layout = ctx.plan.suffix_layout
        out = attend(torch.cat(queries, 1), torch.cat(keys, 1), torch.cat(values, 1), layout=layout,
                     backend=ctx.backend, scale=self.scale)
        num_prefix_q = queries[0].shape[1] if prefix is not None and prefix_queries else 0
        prefix_out = self.vlm.finish(prefix, out[:, :num_prefix_q], None) if num_prefix_q else None
        suffix_out = self.expert.finish(suffix, out[:, num_prefix_q:], ctx.cond) if suffix is not None else None
        return prefix_out, suffix_out, kv
