"""Recipes as in transformer_engine/common/recipe/__init__.py (v2.9): a Recipe base with kind predicates and the
FP8 recipes embodyhpc names (fields reduced to the ones with defaults that matter here)."""

from __future__ import annotations

from dataclasses import dataclass


class Recipe:
    def nvfp4(self) -> bool:
        return False

    def mxfp8(self) -> bool:
        return isinstance(self, MXFP8BlockScaling)

    def delayed(self) -> bool:
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self) -> bool:
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self) -> bool:
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def float8_block_scaling(self) -> bool:
        return isinstance(self, Float8BlockScaling)

    def custom(self) -> bool:
        return False


@dataclass()
class DelayedScaling(Recipe):
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True


@dataclass()
class Float8CurrentScaling(Recipe):
    use_power_2_scales: bool = False


@dataclass()
class MXFP8BlockScaling(Recipe):
    pass


@dataclass()
class Float8BlockScaling(Recipe):
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
