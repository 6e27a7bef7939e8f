"""pi0.5 model shapes by size: `tiny` (CPU tests and demos), `small` (one GPU), `full` (published pi0/pi0.5).

full follows the published design: a PaliGemma backbone (SigLIP So400m/14 at 224 px, Gemma-2B decoder: width 2048,
18 layers, 8 query heads and 1 key/value head of 256, GeGLU MLP 16384, vocabulary 257152) and a Gemma-300M-class
action expert (width 1024, MLP 4096) with the same depth and attention geometry, since both streams attend jointly
in every layer. Expected parameter count: ~3.3B (tests/models/test_pi05_full.py prints the split): 3.24B built,
since the last layer's VLM q/o/MLP are not (layers.JointLayer); 3.35B in the published layout (weights.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from embodyhpc.errors import ConfigError
from embodyhpc.models.shapes import VisionShape


@dataclass(frozen=True)
class StreamShape:
    """One transformer stream (the VLM decoder or the action expert)."""

    width: int
    mlp_dim: int


@dataclass(frozen=True)
class Pi05Shape:
    vision: VisionShape
    vlm: StreamShape
    expert: StreamShape
    depth: int  # layers, shared by both streams
    num_heads: int  # query heads, shared (the streams' q/k/v meet in one attention)
    num_kv_heads: int  # 1: multi-query attention
    head_dim: int
    vocab_size: int
    rope_base: float = 10_000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.vision.image_size % self.vision.patch_size:
            raise ValueError(f"image_size={self.vision.image_size} is not a multiple of the patch size")


SHAPES: dict[str, Pi05Shape] = {
    # Trains on a laptop CPU in seconds; vocabulary: the built-in byte tokenizer (259 ids) rounded up to 64.
    "tiny": Pi05Shape(
        vision=VisionShape(image_size=32, patch_size=8, width=64, depth=2, num_heads=4, mlp_dim=128),
        vlm=StreamShape(width=128, mlp_dim=256), expert=StreamShape(width=64, mlp_dim=128),
        depth=2, num_heads=4, num_kv_heads=1, head_dim=32, vocab_size=320),
    # ~0.2B: one GPU, byte tokenizer; a ViT-S/16-class vision tower.
    "small": Pi05Shape(
        vision=VisionShape(image_size=224, patch_size=16, width=384, depth=12, num_heads=6, mlp_dim=1536),
        vlm=StreamShape(width=768, mlp_dim=3072), expert=StreamShape(width=384, mlp_dim=1536),
        depth=12, num_heads=12, num_kv_heads=1, head_dim=64, vocab_size=320),
    "full": Pi05Shape(
        vision=VisionShape(image_size=224, patch_size=14, width=1152, depth=27, num_heads=16, mlp_dim=4304),
        vlm=StreamShape(width=2048, mlp_dim=16_384), expert=StreamShape(width=1024, mlp_dim=4096),
        depth=18, num_heads=8, num_kv_heads=1, head_dim=256, vocab_size=257_152),
}


def shape_for(size: str) -> Pi05Shape:
    if size not in SHAPES:
        raise ConfigError(f"unknown pi05 size {size!r}; known: {', '.join(SHAPES)}", key="model.size")
    return SHAPES[size]
