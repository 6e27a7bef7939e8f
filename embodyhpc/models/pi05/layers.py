"""Building blocks of the pi0.5 streams: adaptive RMSNorm, GeGLU, the per-stream block and the joint layer where the
VLM stream and the action expert attend together (Gemma's RMSNorm, RoPE: the shared models/norms.py, rope.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from embodyhpc.models.attention import PreparedAttention, attend
from embodyhpc.models.norms import OffsetRMSNorm, rms_normalize
from embodyhpc.models.pi05.plan import TokenPlan, from_rows, to_rows
from embodyhpc.models.pi05.shapes import Pi05Shape, StreamShape
from embodyhpc.models.rope import apply_rope


@dataclass(frozen=True)
class TimeCondition:
    """The flow-matching time embedding per sample, and which sample each action-stream token belongs to."""

    per_sample: torch.Tensor  # [N, cond_dim]
    token_sample: torch.Tensor  # [R, Ta] int64 into per_sample; N (one past the end) for padding tokens


class AdaRMSNorm(nn.Module):
    """RMSNorm whose scale and shift come from the time embedding: x_hat * (1 + scale) + shift, and (gated) a gate
    for the residual branch that follows the norm: x + gate * branch(norm(x)) (pi0.5's adaRMS; DiT's adaLN-Zero).

    One Linear (`modulation`, cond_dim -> 3 * dim, rows [scale | shift | gate]; 2 * dim without the gate) is
    computed once per sample and gathered per token (cheaper than per token: a row packs several samples with
    different times). Initialised (model.init_weights) to scale = shift = 0 and gate = 1, it starts as a plain
    RMSNorm and a plain residual; padding tokens get scale = shift = gate = 0.
    forward returns (normalised x, gate [R, Ta, dim] or None).
    """

    def __init__(self, dim: int, cond_dim: int, eps: float, *, gated: bool = True) -> None:
        super().__init__()
        self.eps, self.dim, self.gated = eps, dim, gated
        self.modulation = nn.Linear(cond_dim, (3 if gated else 2) * dim)

    def forward(self, x: torch.Tensor, cond: TimeCondition) -> tuple[torch.Tensor, torch.Tensor | None]:
        per_sample = self.modulation(cond.per_sample)  # [N, 3 * dim]
        per_sample = torch.cat([per_sample, per_sample.new_zeros(1, per_sample.shape[1])])
        per_token = per_sample[cond.token_sample].float()  # [R, Ta, 3 * dim]
        scale, shift = per_token[..., :self.dim], per_token[..., self.dim:2 * self.dim]
        gate = per_token[..., 2 * self.dim:].type_as(x) if self.gated else None
        return (rms_normalize(x, self.eps) * (1.0 + scale) + shift).type_as(x), gate


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
    and gate their residual branches (the action expert); without, plain RMSNorm (the VLM decoder).
    `keys_values_only`: the block has only attn_norm, k_proj and v_proj (the VLM stream of the last layer, whose
    output nothing reads: see JointLayer).
    """

    def __init__(self, stream: StreamShape, shape: Pi05Shape, cond_dim: int | None = None, *,
                 keys_values_only: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.keys_values_only = keys_values_only

        def norm() -> nn.Module:
            if cond_dim is None:
                return OffsetRMSNorm(stream.width, shape.norm_eps)
            return AdaRMSNorm(stream.width, cond_dim, shape.norm_eps)

        self.attn_norm = norm()
        if not keys_values_only:
            self.q_proj = nn.Linear(stream.width, shape.num_heads * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(stream.width, shape.num_kv_heads * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(stream.width, shape.num_kv_heads * shape.head_dim, bias=False)
        if not keys_values_only:
            self.o_proj = nn.Linear(shape.num_heads * shape.head_dim, stream.width, bias=False)
            self.mlp_norm = norm()
            self.mlp = GeGLU(stream.width, stream.mlp_dim)

    def normed(self, norm: nn.Module, x: torch.Tensor,
               cond: TimeCondition | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(norm(x), the gate of the residual branch after it, or None)."""
        return (norm(x), None) if cond is None else norm(x, cond)

    def keys_values(self, h: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        rows, length = h.shape[:2]
        k = self.k_proj(h).view(rows, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(rows, length, self.num_kv_heads, self.head_dim)
        return apply_rope(k, rope), v

    def queries(self, h: torch.Tensor, rope) -> torch.Tensor:
        return apply_rope(self.q_proj(h).view(*h.shape[:2], self.num_heads, self.head_dim), rope)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, cond: TimeCondition | None,
               attn_gate: torch.Tensor | None) -> torch.Tensor:
        """Residual updates after attention: x + o_proj(attn), then x + mlp(norm(x)), each branch scaled by its
        adaRMS gate where the norms are adaptive."""
        x = _residual(x, self.o_proj(attn.flatten(2)), attn_gate)
        h, mlp_gate = self.normed(self.mlp_norm, x, cond)
        return _residual(x, self.mlp(h), mlp_gate)


def _residual(x: torch.Tensor, branch: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x + branch if gate is None else x + branch * gate


@dataclass(frozen=True)
class LayerContext:
    """What every layer of one pass shares, all built before the first layer: the token plan (gathers), rotary
    angles, time condition, and attention planned for the layouts this pass uses (joint: training layers; prefix:
    filling the inference cache; suffix: action queries over joint keys), None where unused."""

    plan: TokenPlan
    prefix_rope: tuple[torch.Tensor, torch.Tensor]
    suffix_rope: tuple[torch.Tensor, torch.Tensor]
    cond: TimeCondition | None
    joint_attention: PreparedAttention | None = None
    prefix_attention: PreparedAttention | None = None
    suffix_attention: PreparedAttention | None = None


KeyValue = tuple[torch.Tensor, torch.Tensor]  # k, v [1, Np, Hkv, D] of the flat prefix, rotary already applied


class JointLayer(nn.Module):
    """One depth of pi0.5: the VLM block over the prefix and the expert block over the action chunk, both
    producing q/k/v with their own weights, one attention over the concatenation (prefix first), outputs split
    back. This module is the FSDP unit: FSDP2 gathers parameters when a module's forward runs, and both blocks'
    weights are needed inside this one forward.

    `prefix_output=False` (the last layer): nothing reads the prefix stream after it (the action head reads the
    action stream; the prefix feeds later layers only through their keys/values), so the prefix contributes keys
    and values only, and the VLM block holds only attn_norm, k_proj and v_proj: no q/o projection, MLP or MLP norm
    that would never get a gradient yet be gathered, stored and saved (weights.py writes placeholders for them in
    the published layout and ignores them when loading).

    The streams come flat ([1, tokens, width], plan.py): the per-token work (norms, projections, MLPs) sees no
    row padding; only attention gathers the tokens into the packer's rows and scatters its output back.

    Passes (what the caller gives -> what runs):
    - prefix and suffix: training (joint layout; the last layer: suffix layout, prefix as keys/values).
    - prefix only: filling the inference cache (prefix layout); the last layer returns only its K/V.
    - suffix and cached_kv: an Euler step of inference over the cached prefix.
    Returns (prefix out or None, suffix out or None, the prefix's K/V or None).
    """

    def __init__(self, shape: Pi05Shape, *, prefix_output: bool = True) -> None:
        super().__init__()
        self.prefix_output = prefix_output
        self.vlm = StreamBlock(shape.vlm, shape, keys_values_only=not prefix_output)
        self.expert = StreamBlock(shape.expert, shape, cond_dim=shape.expert.width)
        self.scale = 1.0 / math.sqrt(shape.head_dim)

    def forward(self, prefix: torch.Tensor | None, suffix: torch.Tensor | None, *, ctx: LayerContext,
                cached_kv: KeyValue | None = None):
        """prefix [1, Np, vlm width] and suffix [1, Na, expert width] are the flat streams (plan.py); attention
        gathers them into rows and scatters its output back. Returns (prefix out, suffix out, the prefix's K/V);
        the K/V only when filling the inference cache (suffix None): a returned view would otherwise reach FSDP2's
        output hooks on every training step for nothing."""
        plan = ctx.plan
        kv, prefix_q = cached_kv, None
        if prefix is not None:
            h, _ = self.vlm.normed(self.vlm.attn_norm, prefix, None)
            kv = self.vlm.keys_values(h, ctx.prefix_rope)
            if self.prefix_output:
                prefix_q = self.vlm.queries(h, ctx.prefix_rope)
        if kv is None:
            raise ValueError("the suffix needs the prefix: pass prefix tokens or cached_kv")
        if suffix is None:
            if prefix_q is None:  # the last layer of the cache fill: later layers read nothing but these K/V
                return None, None, kv
            rows = plan.prefix_rows
            out = attend(to_rows(prefix_q, rows), to_rows(kv[0], rows), to_rows(kv[1], rows),
                         prepared=ctx.prefix_attention, scale=self.scale)
            return self.vlm.finish(prefix, from_rows(out, plan.prefix_inverse), None, None), None, kv
        h, attn_gate = self.expert.normed(self.expert.attn_norm, suffix, ctx.cond)
        suffix_q = self.expert.queries(h, ctx.suffix_rope)
        k, v = self.expert.keys_values(h, ctx.suffix_rope)
        keys = to_rows(torch.cat([kv[0], k], 1), plan.joint_rows)
        values = to_rows(torch.cat([kv[1], v], 1), plan.joint_rows)
        if prefix_q is not None:  # training, every layer but the last: prefix and action queries, joint rows
            queries = to_rows(torch.cat([prefix_q, suffix_q], 1), plan.joint_rows)
            out = attend(queries, keys, values, prepared=ctx.joint_attention, scale=self.scale)
            out = from_rows(out, plan.joint_inverse)
            num_prefix = prefix.shape[1]
            prefix_out = self.vlm.finish(prefix, out[:, :num_prefix], None, None)
            return prefix_out, self.expert.finish(suffix, out[:, num_prefix:], ctx.cond, attn_gate), None
        # the action queries alone: the last training layer, and inference over the cached prefix
        out = attend(to_rows(suffix_q, plan.suffix_rows), keys, values, prepared=ctx.suffix_attention,
                     scale=self.scale)
        suffix_out = self.expert.finish(suffix, from_rows(out, plan.suffix_inverse), ctx.cond, attn_gate)
        return None, suffix_out, None
