"""Page-locked copies of a model plug-in's batch dataclass, for the DataLoader's pin-memory thread."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TypeVar

import torch

Batch = TypeVar("Batch")


def pin_batch(batch: Batch, host_fields: tuple[str, ...]) -> Batch:
    """`batch` with every tensor field outside `host_fields` in page-locked memory. torch 2.13's
    `pin_memory(data, device)` calls `data.pin_memory()` on types it does not know, which is how a batch's own
    pin_memory reaches here, so that the `non_blocking` copies of its `to()` overlap with compute instead of staging
    through pageable memory. Host fields are not pinned: they never travel, and page-locked memory is scarce. A tensor
    held by two fields is pinned once and stays shared; non-tensor fields are shared as they are."""
    pinned: dict[int, torch.Tensor] = {}
    changes = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor) and f.name not in host_fields:
            if id(value) not in pinned:
                pinned[id(value)] = value.pin_memory()
            changes[f.name] = pinned[id(value)]
    return replace(batch, **changes)
