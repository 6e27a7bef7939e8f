"""transformer_engine.pytorch as the real package exports it (v2.9): Linear, autocast (and the deprecated
fp8_autocast), checkpoint, the availability checks."""

from transformer_engine.pytorch import distributed
from transformer_engine.pytorch.distributed import checkpoint
from transformer_engine.pytorch.module import Linear, TransformerEngineBaseModule
from transformer_engine.pytorch.quantization import (
    autocast,
    fp8_autocast,
    is_fp8_available,
    is_fp8_block_scaling_available,
)

__all__ = ["Linear", "TransformerEngineBaseModule", "autocast", "checkpoint", "distributed", "fp8_autocast",
           "is_fp8_available", "is_fp8_block_scaling_available"]
