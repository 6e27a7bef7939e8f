"""checkpoint as in transformer_engine/pytorch/distributed.py (v2.9): activation checkpointing whose recompute runs in
the FP8 state of the forward (autocast re-entered with the forward's recipe), popping TE's own keyword arguments;
`use_reentrant` defaults to True as in TE; decorated `@torch._disable_dynamo` as TE's (a compiled caller runs it, and
everything it calls, eagerly); the recompute sets in_fp8_activation_recompute_phase(). Only the non-reentrant form is
implemented here, and, as TE's, it recomputes the whole function (torch's own stops early once the saved tensors are
rebuilt)."""

from __future__ import annotations

import contextlib

import torch

from transformer_engine.pytorch.quantization import FP8GlobalStateManager, autocast

_FP8_ACTIVATION_RECOMPUTE_PHASE = False


def in_fp8_activation_recompute_phase() -> bool:
    """True while a checkpointed function is recomputed in backward (TE's prepare_forward then skips its checks)."""
    return _FP8_ACTIVATION_RECOMPUTE_PHASE


@torch._disable_dynamo  # as TE's (v2.9 distributed.py:621): a compiled unit that calls it runs it eagerly
def checkpoint(function, *args, **kwargs):
    use_reentrant = kwargs.pop("use_reentrant", True)
    kwargs.pop("distribute_saved_activations", False)
    kwargs.pop("tp_group", None)
    kwargs.pop("get_rng_state_tracker", None)
    user_context_fn = kwargs.pop("context_fn", None)
    kwargs.pop("determinism_check", None)
    kwargs.pop("debug", None)
    if use_reentrant:
        raise NotImplementedError("the double implements use_reentrant=False only")
    fp8 = FP8GlobalStateManager.is_fp8_enabled()
    recipe = FP8GlobalStateManager.get_fp8_recipe() if fp8 else None

    def contexts():
        forward_ctx, recompute_ctx = user_context_fn() if user_context_fn else (contextlib.nullcontext(),) * 2

        @contextlib.contextmanager
        def recompute():
            global _FP8_ACTIVATION_RECOMPUTE_PHASE
            with recompute_ctx, autocast(enabled=fp8, recipe=recipe):
                _FP8_ACTIVATION_RECOMPUTE_PHASE = fp8
                try:
                    yield
                finally:
                    _FP8_ACTIVATION_RECOMPUTE_PHASE = False

        return forward_ctx, recompute()

    # TE's non-reentrant checkpoint recomputes the whole function (no early stop), as documented there
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=contexts, **kwargs)
