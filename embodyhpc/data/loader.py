"""The training DataLoader: step-level sampling, worker processes with their own decoders,
prefetch, persistent workers, pinned memory on CUDA.

Decoders open lazily inside each worker (readers guarantee it), so the default fork start method
is safe even after the parent has read items; workers persist across epochs so their decoder
caches survive.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from embodyhpc.config.schema import DataConfig
from embodyhpc.data.sampler import StepSampler


def _seed_worker(worker_id: int) -> None:
    # Slurm signals every process of a job step: SIGUSR2 before the time limit, SIGTERM on scancel. The training
    # process decides when to stop and saves that step first (train/preempt.py); a worker dying of the signal
    # would crash it before the save ("DataLoader worker is killed by signal"). Workers leave when the loader
    # shuts them down or their parent dies (the loader's watchdog), and SIGKILL still ends them.
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    # numpy/random in workers would otherwise repeat the parent's stream in every worker
    import random

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a data dependency
        pass


def build_dataloader(dataset: Dataset, data: DataConfig, *, micro_batch_size: int, rank: int, world_size: int,
                     seed: int, device_type: str = "cpu",
                     collate_fn: Callable[[list[Any]], Any] | None = None) -> tuple[DataLoader, StepSampler]:
    """A DataLoader over this rank's share of every epoch, and the sampler whose state checkpoints save."""
    sampler = StepSampler(len(dataset), rank=rank, world_size=world_size, seed=seed)
    workers = data.num_workers
    generator = torch.Generator()
    generator.manual_seed(seed * 10_007 + rank)
    loader = DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=True,  # every rank takes the same number of samples per step (the sampler relies on it)
        num_workers=workers,
        prefetch_factor=data.prefetch_factor if workers else None,
        persistent_workers=workers > 0,
        pin_memory=device_type == "cuda",
        collate_fn=collate_fn,
        worker_init_fn=_seed_worker if workers else None,
        generator=generator,
    )
    return loader, sampler
