"""Activation checkpointing of declared blocks: recompute a block's activations in backward instead of storing
them, trading ~one extra forward of the block for its activation memory.

The wrapper is torch's own checkpoint_wrapper (torch.distributed.algorithms._checkpoint, a private module that
torchtitan uses too, around torch.utils.checkpoint) rather than ours, for one property: its state-dict hooks keep
the keys of the wrapped parameters unchanged, and torch.distributed.checkpoint strips its prefix as well, so
checkpoints do not depend on the AC mode. tests/parallel/test_plan.py pins that behaviour.
Non-reentrant checkpointing: it takes keyword arguments and outputs that are not all tensors (pi0.5's layers take
ctx=... and return None for a stream they skip), and it composes with FSDP2 and torch.compile.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

# what named_parameters()/named_modules() of an ancestor show inside a wrapped block (state_dict() keys do not)
WRAPPED_PREFIX = "_checkpoint_wrapped_module."


def apply_activation_checkpointing(model: nn.Module, names: Iterable[str],
                                   checkpoint_fn: Callable | None = None) -> None:
    """Replace each named submodule of `model` in place by its checkpointed wrapper.

    `checkpoint_fn`: a checkpoint function with torch.utils.checkpoint.checkpoint's calling convention to use
    instead of it, non-reentrant (models.fp8.checkpoint_fn: transformer-engine's, whose recompute re-enters the
    forward's FP8 context)."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        block = model.get_submodule(name)
        if checkpoint_fn is None:
            wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        else:
            wrapped = checkpoint_wrapper(block, checkpoint_fn=checkpoint_fn, use_reentrant=False)
        model.get_submodule(parent_name).register_module(child, wrapped)
