"""The loop's view of the data: micro-batches forever, across epochs, with sampler accounting per optimizer step.

Why a wrapper: the StepSampler must be told what the model consumed (`advance`), not what the DataLoader
iterator yielded, because workers prefetch ahead; and an epoch can end in the middle of an optimizer step.
`next_batch()` counts the samples it hands out since the last `commit()`; the loop commits after each optimizer
step, so the sampler state a checkpoint saves is exactly "everything before this step boundary". When an epoch
runs out, the next epoch starts (set_epoch resets the sampler's position, and the uncommitted samples of the old
epoch go with it: that epoch is finished either way).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from embodyhpc.data.sampler import StepSampler


class BatchStream:
    def __init__(self, loader: DataLoader, sampler: StepSampler) -> None:
        if loader.batch_size is None:
            raise ValueError("the DataLoader needs a batch_size (the stream counts samples per batch)")
        self.loader = loader
        self.sampler = sampler
        self._iterator: Iterator[Any] | None = None
        self._uncommitted = 0

    def next_batch(self) -> Any:
        """The next micro-batch, starting the next epoch when this one has no full batch left."""
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
