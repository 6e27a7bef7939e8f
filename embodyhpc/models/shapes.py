"""What the model families' shapes share, torch-free (validate reads shapes): the SigLIP-style vision tower's shape
(models/vision.py; pi0.5 and GR00T-N1.5 both feed every patch token of such a tower to their language model) and the
token alignment every fp8 GEMM of a block needs."""

from __future__ import annotations

from dataclasses import dataclass

# Token streams that reach a Linear of the blocks are padded so that rows x tokens is a multiple of this: float8
# GEMMs need their token dimension divisible by 16 (transformer-engine asserts 8 or 16 before each GEMM, torchao's
# backward _scaled_mm 16). Each family's token plan pads to it; the vision tower groups its images by it.
TOKEN_ALIGNMENT = 16


@dataclass(frozen=True)
class VisionShape:
    image_size: int  # square input, pixels
    patch_size: int
    width: int
    depth: int
    num_heads: int
    mlp_dim: int

    @property
    def num_patches(self) -> int:
        """Tokens per camera image."""
        return (self.image_size // self.patch_size) ** 2
