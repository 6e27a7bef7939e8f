"""The training DataLoader: step-level sampling, worker processes with their own decoders, prefetch, persistent
workers, pinned memory on CUDA, and workers whose failures and lifetime the training process owns.

Decoders open lazily inside each worker (readers guarantee it), so the default fork start method is safe even after
the parent has read items; workers persist across epochs so their decoder caches survive.

Failures (see data/guard.py): a worker's exception comes back as a record and iterating the loader raises one
DataWorkerError naming the rank, the worker and the error on one line; a worker that died (torch notices) or sent
nothing for data.batch_timeout_s (a stuck read or decode) raises one too. Bad samples fail the same way, or are
skipped and counted with data.on_bad_sample=skip.

Frames (data.image_dtype, data.decode_device): `build_dataloader` sets the dataset's image dtype and its decoder
(data/decode_device.py) before any worker starts; with the cuda decoder the workers start with spawn, since the
training process holds a CUDA context that a forked child cannot use. `TrainingLoader.counters` adds up what the
workers did (data/guard.py LoaderCounters): the loop's data_decode_ms_per_sample and data_loader_samples_per_s.

Order (data.gop_window_batches): `build_sampler` regroups windows of micro-batches by video file and frame
(data/gop_order.py) where the reader can say which file a sample reads; 0 keeps StepSampler's order.

Worker lifetime: workers ignore SIGTERM and SIGUSR2, because Slurm signals every process of a step (scancel, the
time-limit warning) and the training process must outlive them to save its checkpoint at the next step boundary
(train/preempt.py). So nothing but the training process may end them: `TrainingLoader.close()` shuts them down
(torch's own shutdown, then SIGKILL for any that did not leave: torch's fallback is SIGTERM, which they ignore), the
loop closes its loader whichever way it ends, and an exit hook closes any loader left open, before
multiprocessing's own exit hook would wait forever for a worker that ignores its SIGTERM. A worker whose training
process dies gets SIGKILL from the kernel (PR_SET_PDEATHSIG), even when it is stuck in a decoder; the kernel ties it
to the thread that started the workers, so iterate the loader in a thread that lives as long as training does (the
loop iterates it in the main thread).
"""

from __future__ import annotations

import atexit
import ctypes
import signal
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from embodyhpc.config.schema import DataConfig
from embodyhpc.data.errors import DataWorkerError
from embodyhpc.data.gop_order import GopOrderedSampler
from embodyhpc.data.guard import (
    GuardedCollate,
    GuardedDataset,
    LoaderCounters,
    SkipCounter,
    SkippedBatch,
    WorkerFailure,
    one_line,
)
from embodyhpc.data.mixture import MixtureDataset, MixtureSampler
from embodyhpc.data.sampler import StepSampler
from embodyhpc.errors import ConfigError

MAX_SKIPPED_BATCHES_IN_A_ROW = 16
"""data.on_bad_sample=skip: this many micro-batches in a row with no readable sample end the run (a dataset that
cannot be read at all is not a few bad samples, and skipping it would spin forever)."""
KILL_WAIT_S = 5.0
_PR_SET_PDEATHSIG = 1

_open_loaders: weakref.WeakSet[TrainingLoader] = weakref.WeakSet()
_exit_hook_registered = False


def _seed_worker(worker_id: int) -> None:
    # Slurm signals every process of a job step: SIGUSR2 before the time limit, SIGTERM on scancel. The training
    # process decides when to stop and saves that step first (train/preempt.py); a worker dying of the signal
    # would crash it before the save ("DataLoader worker is killed by signal"). Workers leave when the training
    # process shuts them down (TrainingLoader.close: SIGKILL for one that does not), or when it dies (below).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    _die_with_parent()
    # numpy/random in workers would otherwise repeat the parent's stream in every worker
    import random

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a data dependency
        pass


def _die_with_parent() -> None:
    """SIGKILL from the kernel when the training process dies, however it dies (torch's own watchdog looks at the
    parent only between two index requests, never while a worker is stuck in a read or a decode)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        pass


class TrainingLoader(DataLoader):
    """A DataLoader whose iteration raises DataWorkerError for any failure of its workers (see the module doc) and
    whose workers only this process ends (`close`)."""

    def __init__(self, dataset: Dataset, *, rank: int, batch_timeout_s: float, skipped: SkipCounter,
                 counters: LoaderCounters | None = None, **options: Any) -> None:
        super().__init__(dataset, **options)
        self.rank = rank
        self.batch_timeout_s = batch_timeout_s
        self.skipped = skipped
        self.counters = counters if counters is not None else LoaderCounters()
        self._started: Any = None  # torch's iterator of the current epoch (the persistent one, with workers)

    @property
    def skipped_samples(self) -> int:
        """Bad samples this rank's workers skipped so far (data.on_bad_sample=skip)."""
        return self.skipped.value

    @property
    def worker_processes(self) -> list[Any]:
        """The worker processes of the current iteration (none before the first, without workers, after close)."""
        return list(getattr(self._started, "_workers", ()))  # torch's iterator; tests/data pin the attribute

    def __iter__(self) -> Iterator[Any]:
        iterator = super().__iter__()
        self._started = iterator
        if self.num_workers > 0:
            _own(self)
        return self._checked(iterator)

    def _checked(self, iterator: Iterator[Any]) -> Iterator[Any]:
        skipped_in_a_row = 0
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except DataWorkerError:
                raise
            except Exception as exc:  # torch's: a worker died, timed out, or raised past the guards
                raise DataWorkerError(self._describe_loader_error(exc)) from exc
            if isinstance(batch, WorkerFailure):
                who = "the training process" if batch.worker is None else f"data worker {batch.worker}"
                raise DataWorkerError(f"rank {self.rank}: {who} failed {batch.doing}: {batch.error}")
            if isinstance(batch, SkippedBatch):
                skipped_in_a_row += 1
                if skipped_in_a_row >= MAX_SKIPPED_BATCHES_IN_A_ROW:
                    raise DataWorkerError(
                        f"rank {self.rank}: {skipped_in_a_row} micro-batches in a row had no readable sample "
                        f"({self.skipped_samples} samples skipped so far, data.on_bad_sample=skip): the dataset "
                        "is unreadable, not a few bad samples (the rank's log names the first bad samples)")
                continue
            skipped_in_a_row = 0
            yield batch

    def _describe_loader_error(self, exc: Exception) -> str:
        text = one_line(exc)
        if "timed out" in text:
            return (f"rank {self.rank}: no micro-batch from the data workers within data.batch_timeout_s="
                    f"{self.batch_timeout_s:g} s: a worker is stuck reading or decoding (a hung file system, a "
                    f"decoder that never returns) ({text})")
        return f"rank {self.rank}: data loading failed: {text}"

    def close(self) -> None:
        """End this loader's workers now: torch's shutdown (they finish what they do and leave), then SIGKILL for
        those still there (stuck, or left waiting on the SIGTERM they ignore). Iterating again starts new ones."""
        iterator, workers = self._started, self.worker_processes
        self._started = None
        _open_loaders.discard(self)
        if iterator is None:
            return
        shutdown = getattr(iterator, "_shutdown_workers", None)  # tests/data/test_loader_failures.py pins both
        if shutdown is not None:
            shutdown()
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join(KILL_WAIT_S)
        if self._iterator is iterator:  # the DataLoader's persistent iterator: a later iter() builds a new one
            self._iterator = None


def _own(loader: TrainingLoader) -> None:
    """Close `loader` at interpreter exit. The hook is registered when the first workers start, after
    multiprocessing's (exit hooks run last registered first): at exit, this closes the loaders, then multiprocessing
    joins its children, none of which is left."""
    global _exit_hook_registered
    _open_loaders.add(loader)
    if not _exit_hook_registered:
        atexit.register(close_all_loaders)
        _exit_hook_registered = True


def close_all_loaders() -> None:
    """Close every TrainingLoader of this process that still has workers."""
    for loader in list(_open_loaders):
        loader.close()


def build_dataloader(dataset: Dataset, data: DataConfig, *, micro_batch_size: int, rank: int, world_size: int,
                     seed: int, device_type: str = "cpu",
                     collate_fn: Callable[[list[Any]], Any] | None = None) -> tuple[TrainingLoader, StepSampler]:
    """A DataLoader over this rank's share of every epoch, and the sampler whose state checkpoints save."""
    decode_device = configure_frames(dataset, data)
    sampler = build_sampler(dataset, data, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size,
                            seed=seed)
    workers = data.num_workers
    generator = torch.Generator()
    generator.manual_seed(seed * 10_007 + rank)
    skipped = SkipCounter()
    counters = LoaderCounters()
    loader = TrainingLoader(
        GuardedDataset(dataset),
        rank=rank,
        batch_timeout_s=data.batch_timeout_s,
        skipped=skipped,
        counters=counters,
        multiprocessing_context=worker_start_method(decode_device, workers),
        batch_size=micro_batch_size,
        sampler=sampler,
        drop_last=True,  # every rank takes the same number of samples per step (the sampler relies on it)
        num_workers=workers,
        prefetch_factor=data.prefetch_factor if workers else None,
        persistent_workers=workers > 0,
        pin_memory=device_type == "cuda",
        collate_fn=GuardedCollate(collate_fn, data.on_bad_sample, skipped, counters),
        worker_init_fn=_seed_worker if workers else None,
        generator=generator,
        timeout=data.batch_timeout_s if workers else 0,  # torch's own bound on each batch (workers only)
    )
    return loader, sampler


def build_sampler(dataset: Dataset, data: DataConfig, *, micro_batch_size: int, rank: int, world_size: int,
                  seed: int) -> StepSampler:
    """This rank's sampler: StepSampler's order, regrouped by video file in windows of data.gop_window_batches
    micro-batches (data/gop_order.py) where the reader says which file and frame a sample reads. That sampler is
    used with a window of 0 too, so a checkpoint that stopped inside a window resumes with the window off."""
    if isinstance(dataset, MixtureDataset):  # data.datasets: the stream of draw positions (data/mixture.py)
        return MixtureSampler(dataset, rank=rank, world_size=world_size, seed=seed)
    locate = getattr(dataset, "frame_locations", None)
    if locate is None:
        if data.gop_window_batches:
            raise ConfigError(f"{type(dataset).__name__} does not say which video file and frame a sample reads, "
                              "so its samples cannot be grouped by file", key="data.gop_window_batches",
                              fix="set data.gop_window_batches=0")
        return StepSampler(len(dataset), rank=rank, world_size=world_size, seed=seed)
    return GopOrderedSampler(len(dataset), rank=rank, world_size=world_size, seed=seed,
                             micro_batch=micro_batch_size, window_batches=data.gop_window_batches, locate=locate)


def configure_frames(dataset: Dataset, data: DataConfig, *, video_decoder: Any = None) -> str:
    """Give `dataset` data.image_dtype and the decoder of data.decode_device; returns the device decoding ("cpu" or
    "cuda"). A dataset without these options (a test's, a plug-in's) is left as it is, unless the recipe asked for
    something other than the defaults: then one line says which reader cannot."""
    from embodyhpc.data.decode_device import frame_decoder_for, resolve_decode_device

    configure = getattr(dataset, "set_frame_options", None)
    if configure is None:
        if (data.image_dtype, data.decode_device) != ("float32", "cpu"):
            raise ConfigError(f"{type(dataset).__name__} gives float32 frames decoded on the CPU only",
                              key="data.image_dtype", related=("data.decode_device",),
                              fix="set data.image_dtype=float32 and data.decode_device=cpu")
        return "cpu"
    probe = dataset.first_video_file()
    device = resolve_decode_device(data.decode_device, probe=probe, video_decoder=video_decoder)
    decoder = None
    if probe is not None and device != "cpu":
        decoder = frame_decoder_for(device, video_decoder=video_decoder, tolerance_s=dataset.tolerance_s)
    configure(image_dtype=data.image_dtype, decoder=decoder)
    return device


def worker_start_method(decode_device: str, num_workers: int) -> str | None:
    """How the DataLoader starts its workers: spawn where they decode on the GPU (a forked child of a process that
    holds a CUDA context cannot use CUDA), else the platform's default (fork on Linux: nothing is imported again)."""
    return "spawn" if decode_device != "cpu" and num_workers > 0 else None
