"""A SigLIP-style vision tower shared by the model families: patch embedding, learned positions, pre-LayerNorm ViT
blocks, a final LayerNorm.

Full size is So400m/14 at 224 px (27 blocks, width 1152, MLP 4304, 16 heads): 256 tokens per camera image, the
tower of pi0.5's PaliGemma and of GR00T-N1.5's Eagle 2.5. SigLIP's pooling head is not part of it: both feed every
patch token to their language model. Pixels are mapped to [-1, 1] (SigLIP's mean = std = 0.5).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from embodyhpc.models.shapes import TOKEN_ALIGNMENT, VisionShape


class VisionBlock(nn.Module):
    """Pre-LN transformer block: bidirectional multi-head attention within one image, then a GELU MLP."""

    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.num_heads = shape.num_heads
        self.attn_norm = nn.LayerNorm(shape.width, eps=1e-6)
        self.q_proj = nn.Linear(shape.width, shape.width)
        self.k_proj = nn.Linear(shape.width, shape.width)
        self.v_proj = nn.Linear(shape.width, shape.width)
        self.out_proj = nn.Linear(shape.width, shape.width)
        self.mlp_norm = nn.LayerNorm(shape.width, eps=1e-6)
        self.fc1 = nn.Linear(shape.width, shape.mlp_dim)
        self.fc2 = nn.Linear(shape.mlp_dim, shape.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, P, W] -> [M, P, W]
        images, patches, width = x.shape
        h = self.attn_norm(x)
        q, k, v = (proj(h).view(images, patches, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(images, patches, width)
        x = x + self.out_proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x)), approximate="tanh"))


class VisionTower(nn.Module):
    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.shape = shape
        self.patch_embed = nn.Conv2d(3, shape.width, kernel_size=shape.patch_size, stride=shape.patch_size)
        self.position_embedding = nn.Parameter(torch.empty(1, shape.num_patches, shape.width))
        self.blocks = nn.ModuleList(VisionBlock(shape) for _ in range(shape.depth))
        self.post_norm = nn.LayerNorm(shape.width, eps=1e-6)

    @property
    def image_group(self) -> int:
        """Images are encoded in multiples of this many, so that images x patches is a multiple of TOKEN_ALIGNMENT
        (16): float8 GEMMs need their token dimension divisible by 16 (transformer-engine by 8 or 16, torchao's
        backward _scaled_mm by 16). 1 when the patch count is already a multiple (tiny: 16, full: 256); 4 for the
        small size's 196 patches."""
        return TOKEN_ALIGNMENT // math.gcd(self.shape.num_patches, TOKEN_ALIGNMENT)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images [M, 3, H, W] with values in [0, 1] -> patch tokens [M, num_patches, width].

        Images of another size are resized (bilinear) to the tower's square input, as the data pipeline may
        deliver camera frames at their recorded resolution. M is padded with blank images up to a multiple of
        `image_group` for the blocks (their outputs are dropped; attention never mixes images).
        """
        size = self.shape.image_size
        if images.shape[-2:] != (size, size):
            images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        num_images = images.shape[0]
        padding = -num_images % self.image_group
        if padding:
            images = torch.cat([images, images.new_zeros(padding, *images.shape[1:])])
        x = self.patch_embed(images * 2.0 - 1.0)  # SigLIP takes pixels in [-1, 1]
        x = x.flatten(2).transpose(1, 2) + self.position_embedding
        for block in self.blocks:
            x = block(x)
        return self.post_norm(x[:num_images])
