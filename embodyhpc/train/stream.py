"""The loop's view of the data: micro-batches forever, across epochs, with sampler accounting per optimizer step, and
one decision on every rank when any rank's data fails.

Why a wrapper: the StepSampler must be told what the model consumed (`advance`), not what the DataLoader
iterator yielded, because workers prefetch ahead; and an epoch can end in the middle of an optimizer step.
`next_batch()` counts the samples it hands out since the last `commit()`; the loop commits after each optimizer
step, so the sampler state a checkpoint saves is exactly "everything before this step boundary". When an epoch
runs out, the next epoch starts (set_epoch resets the sampler's position, and the uncommitted samples of the old
epoch go with it: that epoch is finished either way).

Failures: when one rank's data fails (data/loader.py raises DataWorkerError: a worker's error, a dead or stuck
worker), the other ranks are about to enter the micro-batch's collectives and would wait there for it until their
timeout. So with a process group, every `next_batch()` ends with one all_reduce of one integer on a CPU (gloo) group
(`group`: train/preempt.cpu_group): which rank, if any, failed; the lowest failing rank then broadcasts its error
and every rank raises the same DataWorkerError, within the same micro-batch. The job ends with that reason whichever
rank's exit is reported first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from embodyhpc.data.errors import DataWorkerError
from embodyhpc.data.sampler import StepSampler


class BatchStream:
    def __init__(self, loader: DataLoader, sampler: StepSampler, group: Any = None) -> None:
        if loader.batch_size is None:
            raise ValueError("the DataLoader needs a batch_size (the stream counts samples per batch)")
        self.loader = loader
        self.sampler = sampler
        self.group = group
        """The CPU process group the data-failure agreement runs on (None: the default group)."""
        self._iterator: Iterator[Any] | None = None
        self._uncommitted = 0

    def next_batch(self) -> Any:
        """The next micro-batch, starting the next epoch when this one has no full batch left. Collective when a
        process group exists: every rank calls it as often (see the module doc)."""
        failure: DataWorkerError | None = None
        batch = None
        try:
            batch = self._next()
        except DataWorkerError as exc:
            failure = exc
        agreed = agree_on_failure(failure, self.group)
        if agreed is not None:
            raise agreed
        return batch

    def _next(self) -> Any:
        for _ in range(2):
            if self._iterator is None:
                self._iterator = iter(self.loader)  # starts at the sampler's current position
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                self.sampler.set_epoch(self.sampler.epoch + 1)
                self._uncommitted = 0
                continue
            self._uncommitted += int(self.loader.batch_size)
            return batch
        raise RuntimeError(f"a fresh epoch yielded no batch: {self.sampler.num_samples} samples are too few for "
                           f"micro-batches of {self.loader.batch_size} on {self.sampler.world_size} ranks "
                           "(lower train.micro_batch_size or use a larger dataset)")

    def commit(self) -> None:
        """The optimizer step that used the batches handed out since the last commit is done."""
        self.sampler.advance(self._uncommitted)
        self._uncommitted = 0

    def loader_metrics(self) -> dict[str, float]:
        """What this rank's DataLoader workers did since the last call (data/guard.py LoaderCounters), for the log
        step's metrics: data_decode_ms_per_sample (video decode time per sample delivered) and
        data_loader_samples_per_s (samples the workers deliver per second while busy, all workers together: with
        samples_per_s_per_device far below it, the run is not input-bound). Nothing before a batch was delivered,
        or for a loader without counters. This rank's own: train/log_step.over_ranks makes them the run's."""
        counters = getattr(self.loader, "counters", None)
        if counters is None:
            return {}
        return loader_rates(*counters.take(), num_workers=int(getattr(self.loader, "num_workers", 0)))

    def close(self) -> None:
        """End the loader's workers now (data/loader.py TrainingLoader.close); the loop calls it however it ends."""
        self._iterator = None
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()


def agree_on_failure(failure: DataWorkerError | None, group: Any = None) -> DataWorkerError | None:
    """Every rank, at the same point: the failure of the lowest rank that failed, or None when none did.

    One all_reduce(MIN) of one int64 on `group` (a gloo group, or None for a gloo default group); a broadcast of the
    error's text only when some rank failed. Without an initialised process group it answers for this process alone.
    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return failure
    world = dist.get_world_size()
    failed = torch.tensor([dist.get_rank() if failure is not None else world], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MIN, group=group)
    first = int(failed.item())
    if first == world:
        return None
    message = [str(failure) if failure is not None else None]
    dist.broadcast_object_list(message, src=first, group=group)
    if failure is not None and dist.get_rank() == first:
        return failure
    return DataWorkerError(str(message[0]))


def loader_rates(samples: int, decode_s: float, busy_s: float, *, num_workers: int) -> dict[str, float]:
    """data_decode_ms_per_sample = 1000 * decode_s / samples; data_loader_samples_per_s = samples / busy_s times the
    workers decoding side by side (1 without workers: the training process reads the data itself)."""
    if samples <= 0 or busy_s <= 0:
        return {}
    return {"data_decode_ms_per_sample": 1000.0 * decode_s / samples,
            "data_loader_samples_per_s": max(num_workers, 1) * samples / busy_s}

