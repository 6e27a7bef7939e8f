"""GR00T-N1.5 shapes by size: `tiny` (CPU tests and the demo) and `full` (the published nvidia/GR00T-N1.5-3B).

full, as read from NVIDIA's Isaac-GR00T N1.5 configs (../shared/reference/libero-and-groot.md, section B):
- Eagle 2.5 VLM: SigLIP vision tower (224 px, patch 14, width 1152, 27 blocks, 16 heads, MLP 4304: 256 tokens per
  image), a linear projector 1152 -> 2048, Qwen3-1.7B (width 2048, 16 query / 8 key-value heads of 128, FFN 6144,
  vocabulary 151680, RoPE base 1e6) cut after layer 12 (its final RMSNorm applied to layer 12's output).
- Flow-matching action head: VL LayerNorm + 4-block self-attention adapter (32 heads x 64, FFN 4x), category MLPs
  over 32 embodiments (state 64 -> 1024 -> 1536, action encoder 32 -> 1536 with a sinusoidal timestep, decoder
  1024 -> 1024 -> 32), 32 future tokens, a 16-block DiT (32 heads x 48 = 1536, FFN 6144, even blocks cross-attend to
  the VLM, odd blocks self-attend), output width 1024.
Parameters: ~2.40B used in the forward pass, ~2.72B in the published layout (which also stores SigLIP's unused
pooling head and the LLM's unused lm_head): tests/models/test_groot_full.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from embodyhpc.errors import ConfigError
from embodyhpc.models.shapes import VisionShape


@dataclass(frozen=True)
class LlmShape:
    """The Qwen3-style language model, truncated to `depth` layers."""

    width: int
    depth: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    vocab_size: int
    rope_base: float = 1_000_000.0
    norm_eps: float = 1e-6


@dataclass(frozen=True)
class HeadShape:
    """The flow-matching action head."""

    vl_heads: int  # the VL self-attention adapter: heads x head_dim = llm width
    vl_depth: int
    dit_width: int  # input_embedding_dim (= DiT heads x head_dim)
    dit_heads: int
    dit_depth: int  # even blocks cross-attend, odd blocks self-attend
    hidden: int  # DiT output width and the category MLPs' hidden width (hidden_size)
    max_state_dim: int
    num_future_tokens: int
    num_embodiments: int
    max_seq_len: int  # rows of the action-position embedding
    timestep_dim: int = 256  # the DiT's sinusoidal timestep features
    num_timestep_buckets: int = 1000  # t in [0, 1] enters the model as int(t * 1000)
    dropout: float = 0.0

    @property
    def dit_head_dim(self) -> int:
        return self.dit_width // self.dit_heads


@dataclass(frozen=True)
class GrootShape:
    vision: VisionShape
    llm: LlmShape
    head: HeadShape

    def __post_init__(self) -> None:
        if self.llm.num_heads % self.llm.num_kv_heads:
            raise ValueError("llm num_heads must be a multiple of num_kv_heads")
        if self.llm.width % self.head.vl_heads or self.head.dit_width % self.head.dit_heads:
            raise ValueError("widths must divide by their head counts")
        if self.vision.image_size % self.vision.patch_size:
            raise ValueError("image_size must be a multiple of the patch size")


SHAPES: dict[str, GrootShape] = {
    # Trains on a laptop CPU in minutes; vocabulary: the built-in byte tokenizer (259 ids) rounded up to 64.
    "tiny": GrootShape(
        vision=VisionShape(image_size=32, patch_size=8, width=64, depth=2, num_heads=4, mlp_dim=128),
        llm=LlmShape(width=128, depth=2, num_heads=4, num_kv_heads=2, head_dim=32, mlp_dim=256, vocab_size=320),
        # the DiT's heads are full size's 48 wide; at width 96 (and a 64-wide decoder) the demo's 600 steps left the
        # policy near the mean action (open-loop MSE 0.59-0.65 vs the actions' variance 0.46, in 5 runs); 192/128
        # reached 0.09 in the same steps (measured on the demo data, one process)
        head=HeadShape(vl_heads=4, vl_depth=1, dit_width=192, dit_heads=4, dit_depth=4, hidden=128, max_state_dim=64,
                       num_future_tokens=4, num_embodiments=32, max_seq_len=64)),
    "full": GrootShape(
        vision=VisionShape(image_size=224, patch_size=14, width=1152, depth=27, num_heads=16, mlp_dim=4304),
        llm=LlmShape(width=2048, depth=12, num_heads=16, num_kv_heads=8, head_dim=128, mlp_dim=6144,
                     vocab_size=151_680),
        head=HeadShape(vl_heads=32, vl_depth=4, dit_width=1536, dit_heads=32, dit_depth=16, hidden=1024,
                       max_state_dim=64, num_future_tokens=32, num_embodiments=32, max_seq_len=1024, dropout=0.2)),
}


def shape_for(size: str) -> GrootShape:
    if size not in SHAPES:
        raise ConfigError(f"unknown groot size {size!r}; known: {', '.join(SHAPES)}", key="model.size",
                          fix="set model.size=tiny (CPU) or full (the published GR00T-N1.5-3B shapes)")
    return SHAPES[size]
