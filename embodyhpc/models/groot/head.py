"""GR00T-N1.5's flow-matching action head (System 1): the VL adapter over the VLM features, per-embodiment state and
action encoders, learnable future tokens and a DiT whose even blocks cross-attend to the VLM features and whose
odd blocks self-attend over [state, future tokens, action tokens]; a per-embodiment decoder reads the velocity
off the last `horizon` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from embodyhpc.models.attention import PreparedAttention
from embodyhpc.models.groot.layers import (
    ActionEncoder,
    CategorySpecificMLP,
    DiTBlock,
    TimestepEncoder,
    VLBlock,
)
from embodyhpc.models.groot.plan import from_rows, to_rows
from embodyhpc.models.groot.shapes import GrootShape


@dataclass(frozen=True)
class DiTContext:
    """What the DiT blocks of one pass share: the planned cross-attention and the query gathers."""

    cross: PreparedAttention
    q_rows: torch.Tensor  # [R, Tq] into the flat action-side tokens [N*S'] (+ zero)
    q_inverse: torch.Tensor  # [N*S'] into R*Tq (+ zero)
    num_tokens: int  # S: the real action-side tokens of a sample
    token_stride: int  # S' >= S: with the alignment tokens after them (plan.py)

    def to_rows(self, q: torch.Tensor) -> torch.Tensor:
        """[N, S', H, hd] -> [R, Tq, H, hd] (the real tokens only)."""
        return to_rows(q.flatten(0, 1), self.q_rows)

    def from_rows(self, out: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """[R, Tq, H, hd] -> [N, S', H, hd] (zeros on the alignment tokens)."""
        return from_rows(out, self.q_inverse).unflatten(0, tuple(shape))


class SelfAttentionStack(nn.Module):
    def __init__(self, width: int, heads: int, depth: int, dropout: float) -> None:
        super().__init__()
        self.transformer_blocks = nn.ModuleList(VLBlock(width, heads, dropout) for _ in range(depth))

    def forward(self, x: torch.Tensor, prepared: PreparedAttention) -> torch.Tensor:
        for block in self.transformer_blocks:
            x = block(x, prepared)
        return x


class DiT(nn.Module):
    def __init__(self, shape: GrootShape) -> None:
        super().__init__()
        head = shape.head
        self.timestep_encoder = TimestepEncoder(head.timestep_dim, head.dit_width)
        self.transformer_blocks = nn.ModuleList(
            DiTBlock(head.dit_width, head.dit_heads, shape.llm.width, cross=i % 2 == 0, dropout=head.dropout)
            for i in range(head.dit_depth))
        self.proj_out_1 = nn.Linear(head.dit_width, 2 * head.dit_width)
        self.proj_out_2 = nn.Linear(head.dit_width, head.hidden)

    def forward(self, x: torch.Tensor, context: torch.Tensor, timestep: torch.Tensor, ctx: DiTContext) -> torch.Tensor:
        temb = self.timestep_encoder(timestep)
        for block in self.transformer_blocks:
            x = block(x, temb, context, ctx)
        shift, scale = self.proj_out_1(F.silu(temb)).float().chunk(2, dim=-1)
        x = F.layer_norm(x.float(), x.shape[-1:], eps=1e-6) * (1.0 + scale[:, None]) + shift[:, None]
        return self.proj_out_2(x.to(self.proj_out_2.weight.dtype))


class FlowMatchingHead(nn.Module):
    def __init__(self, shape: GrootShape, *, action_horizon: int, action_dim: int) -> None:
        super().__init__()
        head, width = shape.head, shape.llm.width
        if action_horizon > head.max_seq_len:
            raise ValueError(f"action_horizon={action_horizon} exceeds the {head.max_seq_len} action positions")
        self.shape, self.action_horizon = shape, action_horizon
        self.vlln = nn.LayerNorm(width, eps=1e-5)
        self.vl_self_attention = SelfAttentionStack(width, head.vl_heads, head.vl_depth, head.dropout)
        self.state_encoder = CategorySpecificMLP(head.num_embodiments, head.max_state_dim, head.hidden, head.dit_width)
        self.action_encoder = ActionEncoder(head.num_embodiments, action_dim, head.dit_width)
        self.action_decoder = CategorySpecificMLP(head.num_embodiments, head.hidden, head.hidden, action_dim)
        self.future_tokens = nn.Embedding(head.num_future_tokens, head.dit_width)
        self.position_embedding = nn.Embedding(head.max_seq_len, head.dit_width)
        self.model = DiT(shape)

    @property
    def tokens_per_sample(self) -> int:
        return 1 + self.shape.head.num_future_tokens + self.action_horizon

    def encode_vl(self, features: torch.Tensor, prepared: PreparedAttention, key_width: int) -> torch.Tensor:
        """VLM features [R, T, width] -> the DiT's cross-attention context [R, key_width, width] (padding columns
        after the rows: plan.key_width)."""
        x = self.vl_self_attention(self.vlln(features), prepared)
        return F.pad(x, (0, 0, 0, key_width - x.shape[1]))

    def velocity(self, context: torch.Tensor, state: torch.Tensor, noisy_actions: torch.Tensor,
                 timestep: torch.Tensor, embodiment: torch.Tensor, ctx: DiTContext) -> torch.Tensor:
        """v [N, H, A] from the context, state [N, max_state_dim], x_t [N, H, A] and bucketed timesteps [N]."""
        dtype = self.future_tokens.weight.dtype
        state_tokens = self.state_encoder(state[:, None].to(dtype), embodiment)  # [N, 1, D]
        actions = self.action_encoder(noisy_actions.to(dtype), timestep, embodiment)  # [N, H, D]
        actions = actions + self.position_embedding.weight[: self.action_horizon][None].to(actions.dtype)
        future = self.future_tokens.weight[None].expand(state.shape[0], -1, -1).to(actions.dtype)
        x = torch.cat([state_tokens.to(actions.dtype), future, actions], dim=1)  # [N, S, D]
        x = F.pad(x, (0, 0, 0, ctx.token_stride - x.shape[1]))  # [N, S', D]: alignment tokens (plan.py)
        out = self.model(x, context, timestep, ctx)[:, :ctx.num_tokens]
        return self.action_decoder(out, embodiment)[:, -self.action_horizon:].float()
