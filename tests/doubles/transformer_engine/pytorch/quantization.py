"""FP8GlobalStateManager and autocast as in transformer_engine/pytorch/quantization.py (v2.9): a process-global
"FP8 enabled" flag and recipe, set by the autocast context and restored on exit (contexts nest)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformer_engine.common.recipe import DelayedScaling, Recipe


class FP8GlobalStateManager:
    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE: Recipe | None = None
    FP8_DISTRIBUTED_GROUP = None
    FP8_PARAMETERS = False

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return cls.FP8_ENABLED

    @classmethod
    def is_fp8_calibration(cls) -> bool:
        return cls.FP8_CALIBRATION

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls.FP8_RECIPE if cls.FP8_RECIPE is not None else DelayedScaling()

    @classmethod
    def get_fp8_group(cls):
        return cls.FP8_DISTRIBUTED_GROUP

    @classmethod
    def with_fp8_parameters(cls) -> bool:
        return cls.FP8_PARAMETERS

    @classmethod
    def fp8_graph_capturing(cls) -> bool:
        return False

    @classmethod
    def get_autocast_state(cls) -> tuple:
        return cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP = state


def check_recipe_support(recipe: Recipe | None) -> None:
    """The real one asserts the GPU supports the recipe; the double simulates a device that supports them all."""


def is_fp8_available(return_reason: bool = False):
    return (True, "") if return_reason else True


def is_fp8_block_scaling_available(return_reason: bool = False):
    return (True, "") if return_reason else True


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Recipe | None = None,
             amax_reduction_group=None, _graph: bool = False) -> Iterator[None]:
    if enabled:
        check_recipe_support(recipe)
    state = FP8GlobalStateManager.get_autocast_state()
    FP8GlobalStateManager.FP8_ENABLED = enabled
    FP8GlobalStateManager.FP8_CALIBRATION = calibrating
    FP8GlobalStateManager.FP8_RECIPE = recipe if recipe is not None else DelayedScaling()
    FP8GlobalStateManager.FP8_DISTRIBUTED_GROUP = amax_reduction_group
    try:
        yield
    finally:
        FP8GlobalStateManager.set_autocast_state(state)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Recipe | None = None,
                 fp8_group=None, _graph: bool = False):
    """Deprecated in the real library since 2.9 (it warns); kept for callers of the old name."""
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group,
                    _graph=_graph)
