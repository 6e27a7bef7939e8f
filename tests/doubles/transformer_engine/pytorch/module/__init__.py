from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
from transformer_engine.pytorch.module.linear import Linear

__all__ = ["Linear", "TransformerEngineBaseModule"]
