"""The checkpoint's own gloo process group, and the few agreements the ranks make on it.

Why a group of its own: an async save runs DCP's collectives (plan exchange, the final gather) in a background
thread while the training loop runs FSDP's all-gathers on the default group. Two threads issuing collectives on
one group in different orders on different ranks deadlock (seen on CPU: a 300 s hang); on a separate group each
stream of collectives stays ordered. Gloo, because DCP's collectives carry small CPU objects and async save
requires a CPU backend even when training uses NCCL.

Only one thread uses this group at any time: the Checkpointer waits for the save in flight before its main thread
issues anything here. Without torch.distributed (one process, no init_process_group) every method is local.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from embodyhpc.checkpoint.errors import CheckpointError

T = TypeVar("T")


class CheckpointGroup:
    def __init__(self, timeout_s: float | None = None) -> None:
        """Collective when torch.distributed is initialised: every rank must construct it, in the same order
        relative to other new_group calls."""
        self.distributed = dist.is_available() and dist.is_initialized()
        self.group: dist.ProcessGroup | None = None
        if self.distributed:
            timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
            self.group = dist.new_group(backend="gloo", timeout=timeout)
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.group)

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff `flag` was True on every rank."""
        if not self.distributed:
            return flag
        value = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value on every rank (so all ranks act on one reading of a shared filesystem)."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group)
        return int(tensor.item())

    def on_rank0(self, what: str, fn: Callable[[], T]) -> T | None:
        """Run `fn` (which must not run collectives) on rank 0 only, then tell every rank whether it worked.

        Every rank calls this. If rank 0 fails, all ranks raise instead of the others waiting forever at their
        next collective. Returns fn's result on rank 0, None elsewhere.
        """
        result: T | None = None
        error: BaseException | None = None
        if self.is_rank0:
            try:
                result = fn()
            except Exception as exc:  # reported on every rank below
                error = exc
        ok = self.broadcast_int(0 if error is not None else 1)
        if error is not None:
            raise CheckpointError(f"{what} failed on rank 0: {error}") from error
        if not ok:
            raise CheckpointError(f"{what} failed on rank 0 (see its log)")
        return result
