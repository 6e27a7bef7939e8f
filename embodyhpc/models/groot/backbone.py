"""The Eagle-2.5-style VLM of GR00T-N1.5: a SigLIP vision tower, a linear projector, and a Qwen3-style LLM cut
after `llm.depth` layers whose final RMSNorm output feeds the action head (frozen in fine-tuning by default).

The vision tower is the shared SigLIP-style tower (models/vision.py: patch embedding, learned positions, pre-LN
blocks, post-LN; pixels mapped to [-1, 1], i.e. mean = std = 0.5; no pooling head); the norms are Qwen's RMSNorm
(models/norms.py).
The LLM runs on the VLM tokens in the packer's rows (plan.py), causal within each sample (Qwen3 is a causal LM;
the sample's image tokens come first, then its instruction), with RoPE positions restarting per sample; its
attention goes through the attention backend seam (models/attention.py, a causal layout: flash-attn's varlen
kernel with causal=True on GPU), as every other attention of both model families.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from embodyhpc.models.attention import PreparedAttention, attend
from embodyhpc.models.groot.plan import GrootPlan
from embodyhpc.models.groot.shapes import GrootShape, LlmShape
from embodyhpc.models.norms import RMSNorm
from embodyhpc.models.rope import apply_rope, rope_angles
from embodyhpc.models.vision import VisionTower


class QwenAttention(nn.Module):
    def __init__(self, shape: LlmShape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_proj = nn.Linear(shape.width, shape.num_heads * shape.head_dim, bias=False)
        self.k_proj = nn.Linear(shape.width, shape.num_kv_heads * shape.head_dim, bias=False)
        self.v_proj = nn.Linear(shape.width, shape.num_kv_heads * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * shape.head_dim, shape.width, bias=False)
        self.q_norm = RMSNorm(shape.head_dim, shape.norm_eps)  # Qwen3: per-head norms on queries and keys
        self.k_norm = RMSNorm(shape.head_dim, shape.norm_eps)

    def forward(self, x: torch.Tensor, angles, prepared: PreparedAttention) -> torch.Tensor:
        q = apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim))), angles)
        k = apply_rope(self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))), angles)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        return self.o_proj(attend(q, k, v, prepared=prepared).flatten(2))


class QwenMLP(nn.Module):
    def __init__(self, width: int, mlp_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, mlp_dim, bias=False)
        self.up_proj = nn.Linear(width, mlp_dim, bias=False)
        self.down_proj = nn.Linear(mlp_dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenLayer(nn.Module):
    def __init__(self, shape: LlmShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.width, shape.norm_eps)
        self.self_attn = QwenAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.width, shape.norm_eps)
        self.mlp = QwenMLP(shape.width, shape.mlp_dim)

    def forward(self, x: torch.Tensor, angles, prepared: PreparedAttention) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), angles, prepared)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleBackbone(nn.Module):
    def __init__(self, shape: GrootShape) -> None:
        super().__init__()
        self.shape = shape
        self.vision = VisionTower(shape.vision)
        self.projector = nn.Linear(shape.vision.width, shape.llm.width)
        self.embed_tokens = nn.Embedding(shape.llm.vocab_size, shape.llm.width)
        self.layers = nn.ModuleList(QwenLayer(shape.llm) for _ in range(shape.llm.depth))
        self.norm = RMSNorm(shape.llm.width, shape.llm.norm_eps)

    def forward(self, images: torch.Tensor, text_ids: torch.Tensor, plan: GrootPlan,
                llm: PreparedAttention) -> torch.Tensor:
        """images [N, C, 3, H, W] in [0, 1], text_ids [N, L] -> VLM features [R, T, llm width] in the plan's rows
        (zeros where a row is padded); `llm`: plan.llm_layout prepared for this pass."""
        dtype = self.projector.weight.dtype
        patches = self.projector(self.vision(images.flatten(0, 1).to(dtype)))  # [N*C, P, width]
        text = self.embed_tokens(text_ids).flatten(0, 1).to(patches.dtype)
        source = torch.cat([patches.flatten(0, 1), text, patches.new_zeros(1, patches.shape[-1])])
        x = source[plan.vl_source]
        angles = rope_angles(plan.vl_positions, self.shape.llm.head_dim, self.shape.llm.rope_base)
        for layer in self.layers:
            x = layer(x, angles, llm)
        return self.norm(x) * (plan.vl_segments >= 0)[..., None].to(x.dtype)
