"""FP8GlobalStateManager and autocast as in transformer_engine/pytorch/quantization.py (v2.9): a process-global
"FP8 enabled" flag and recipe, set by the autocast context and restored on exit (contexts nest), and the region depth
(AUTOCAST_DEPTH, autocast_enter / autocast_exit, v2.9 quantization.py:553-600; `quantization_state.autocast_depth`
from v2.15, process-global as well).

Backward inside an FP8 region. transformer-engine does not refuse it: nothing in 2.9-2.18 checks the region in
backward. It documents that the backward must run after the region exits (docs/examples/fp8_primer.ipynb, "Handling
backward pass", line 248 at v2.9, v2.14 and v2.18: "the backward call needs to happen outside of the `autocast`
context manager"; docs/examples/quickstart.ipynb:551 at v2.9: autocast "must exit before starting a backward
pass"), and its own reentrant checkpoint leaves the region before it calls backward (distributed.py:447-450 at v2.9,
465-468 at v2.18: "backward does not require entering autocast context"). The reason is the region's bookkeeping:
delayed scaling reduces the forward amaxes over `amax_reduction_group` and updates the scales when the outermost
region exits (autocast_exit, quantization.py:597-600 at v2.9, 608 at v2.14, 769 at v2.18), and the backward amaxes in
the backward of the region's first module (module/linear.py:961-963 at v2.9, 1395 at v2.18). A backward inside the
region runs with the region still open (FP8_ENABLED set, depth >= 1): the forward reduction and scale update move
after the backward, and te.distributed.checkpoint's recompute in that backward enters its autocast nested (depth 2),
so its exit skips the reduction and update it makes at depth 1 -> 0. TE computes on silently, on a schedule of
scale updates it neither supports nor tests. The double REFUSES instead (module/linear.py: an AssertionError from
the backward of any te.Linear while an enabled region is open): stricter than TE's behaviour, as strict as TE's
contract, so that a CPU test sees what a GPU run would silently get wrong."""

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
    AUTOCAST_DEPTH = 0
    ENABLED_REGIONS = 0  # not TE API: how many open regions have enabled=True (the backward check reads it)

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

    @classmethod
    def autocast_enter(cls, enabled: bool, calibrating: bool, fp8_recipe: Recipe | None, fp8_group) -> None:
        cls.FP8_ENABLED = enabled
        cls.FP8_CALIBRATION = calibrating
        cls.FP8_RECIPE = fp8_recipe if fp8_recipe is not None else DelayedScaling()
        cls.FP8_DISTRIBUTED_GROUP = fp8_group
        cls.AUTOCAST_DEPTH += 1
        cls.ENABLED_REGIONS += bool(enabled)

    @classmethod
    def autocast_exit(cls, enabled: bool) -> None:
        """TE reduces the delayed-scaling amaxes here when the outermost enabled region exits; the double records
        amaxes in each forward (module/base.py record_amax) and keeps only the depth."""
        cls.AUTOCAST_DEPTH -= 1
        cls.ENABLED_REGIONS -= bool(enabled)


def assert_backward_outside_autocast() -> None:
    """Not TE API: the double's refusal of a backward inside an enabled region (module doc)."""
    assert FP8GlobalStateManager.ENABLED_REGIONS == 0, (
        "backward ran inside te.autocast: transformer-engine requires the backward after the FP8 region exits "
        "(its amax reduction and scale update happen at the exit; fp8_primer.ipynb 'Handling backward pass')")


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
    FP8GlobalStateManager.autocast_enter(enabled, calibrating, recipe, amax_reduction_group)
    try:
        yield
    finally:
        FP8GlobalStateManager.set_autocast_state(state)
        FP8GlobalStateManager.autocast_exit(enabled)


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Recipe | None = None,
                 fp8_group=None, _graph: bool = False):
    """Deprecated in the real library since 2.9 (it warns); kept for callers of the old name."""
    return autocast(enabled=enabled, calibrating=calibrating, recipe=fp8_recipe, amax_reduction_group=fp8_group,
                    _graph=_graph)
