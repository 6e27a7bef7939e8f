"""Telling torch.compile up front which sizes of a compiled unit's inputs change from batch to batch.

Packed batches change many sizes at once and from step to step: rows, row length, flat stream lengths, samples,
segments, gathered tokens. Left to automatic dynamic shapes, a compiled block recompiles each time one more size
is seen to change (7 recompiles of the joint layer in 20 batches, measured by bench/compile_blocks.py), until every
size is symbolic. Marking them all before the first call compiles the dynamic graph at once. `maybe_mark_dynamic`
never fails: a size a block really needs fixed (a feature width meeting a weight) is specialised by its guard, as
before.

The marks go on in a forward pre-hook of each compiled unit registered after fully_shard, so they land on the
tensors the compiled forward receives: FSDP2's own pre-forward hands a unit new tensor objects for its inputs that
require grad (RegisterPostBackwardFunction), and marks set on the originals would be lost (they were: every
stream length stayed static and recompiled). The hooks run eagerly (torch skips nn.Module's call machinery) and
cost an attribute write per tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch._dynamo


def mark_sizes_dynamic(value: Any) -> Any:
    """Mark every dim of every tensor in `value` (tensors, dataclasses, tuples, lists, dicts) as one that may
    change between calls; returns `value`."""
    import torch._dynamo

    if isinstance(value, torch.Tensor):
        for dim in range(value.ndim):
            torch._dynamo.maybe_mark_dynamic(value, dim)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            mark_sizes_dynamic(getattr(value, field.name))
    elif isinstance(value, (tuple, list)):
        for item in value:
            mark_sizes_dynamic(item)
    elif isinstance(value, dict):
        for item in value.values():
            mark_sizes_dynamic(item)
    return value


@torch._dynamo.disable
def mark_inputs_dynamic_hook(module, args, kwargs):
    """forward pre-hook (with_kwargs=True): every size of every tensor input may change. Runs outside dynamo, like
    FSDP2's own hooks, so the marks are set before the compiled forward sees its inputs."""
    mark_sizes_dynamic(args)
    mark_sizes_dynamic(kwargs)
    return None
