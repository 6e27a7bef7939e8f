"""Rank jobs for tests/train/test_data_failures.py: the loop of workers.py on 2 ranks, with one rank's dataset broken
so that its data fails part-way through training. Not a test module (no test_ prefix): the forkserver ranks import it.

Each job returns what its rank saw: the DataWorkerError's text (or None), how long after the failure began (the time
the broken dataset wrote to `run_dir/failed_at`) the rank had the error, the metrics of its last logged step and the
DataLoader workers still alive in it.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from embodyhpc.config.resolve import resolve
from embodyhpc.data.errors import DataWorkerError
from embodyhpc.train import loop
from tests.train import workers

FAILING_READ = 5
"""The read (counted per process: each DataLoader worker counts its own) at which the broken dataset fails."""


class BrokenDataset:
    """`how`: raise (an OSError while reading: a bad sample), chunk (an action chunk one step short: the collate's
    ConfigError), hang (a read that never returns)."""

    def __init__(self, inner: Any, how: str, run_dir: str) -> None:
        self.inner, self.how, self.run_dir = inner, how, run_dir
        self.reads = 0

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        self.reads += 1
        item = self.inner[index]
        if self.reads != FAILING_READ:
            return item
        marker = Path(self.run_dir) / "failed_at"
        if not marker.exists():
            marker.write_text(repr(time.time()))
        if self.how == "raise":
            raise OSError(f"sample {index}: unexpected end of file")
        if self.how == "hang":
            time.sleep(3600)
        return {**item, "action": item["action"][:-1], "action_is_pad": item["action_is_pad"][:-1]}


def broken_data_job(rank: int, world_size: int, run_dir: str, fail_rank: int, how: str, num_workers: int,
                    options: dict[str, Any]) -> dict[str, Any]:
    """`options`: fields of the data section to change (batch_timeout_s, on_bad_sample)."""
    cfg = workers.recipe(world_size, steps=4, every_steps=100, export_final=False, num_workers=num_workers)
    data = dataclasses.replace(cfg.data, **options)
    opened = loop._open
    loop._open = lambda data_cfg, model_cfg, *seed: (BrokenDataset(opened(data_cfg, model_cfg, *seed), how, run_dir)
                                                    if rank == fail_rank else opened(data_cfg, model_cfg, *seed))
    error, result = None, None
    try:
        result = loop.train(dataclasses.replace(cfg, data=data), resolve(cfg), run_dir=run_dir,
                            dist_env=SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank),
                            device="cpu", sinks=[])
    except DataWorkerError as exc:
        error = str(exc)
    caught_at = time.time()
    marker = Path(run_dir) / "failed_at"
    return {"error": error, "after_failure_s": caught_at - float(marker.read_text()) if marker.exists() else None,
            "last_metrics": result.last_metrics if result is not None else None,
            "live_workers": [p.pid for p in multiprocessing.active_children() if p.is_alive()], "pid": os.getpid()}


def scancel_job(rank: int, world_size: int, run_dir: str, num_workers: int) -> dict[str, Any]:
    """Every rank and its DataLoader workers get SIGTERM just before the rank fetches its 3rd micro-batch (step 2 of
    2 micro-batches each), as `scancel` signals every process of a job step: the rank saves that step and stops."""
    import itertools
    import signal

    from embodyhpc.train.stream import BatchStream

    cfg = workers.recipe(world_size, steps=6, every_steps=100, export_final=False, num_workers=num_workers)
    fetches = itertools.count(1)
    next_batch = BatchStream.next_batch
    signalled: list[int] = []

    def signalling_next_batch(self: BatchStream) -> Any:
        if next(fetches) == 3:
            signalled.extend(w.pid for w in self.loader.worker_processes)
            for pid in [*signalled, os.getpid()]:
                os.kill(pid, signal.SIGTERM)
        return next_batch(self)

    BatchStream.next_batch = signalling_next_batch  # this rank's process only
    result = loop.train(cfg, resolve(cfg), run_dir=run_dir,
                        dist_env=SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank), device="cpu",
                        sinks=[])
    return {"stopped_by": result.stopped_by, "final_step": result.final_step, "signalled_workers": signalled,
            "live_workers": [p.pid for p in multiprocessing.active_children() if p.is_alive()]}


def side_group_failure_job(rank: int, world_size: int) -> dict[str, Any]:
    """As under NCCL (the default group answers "nccl" to get_backend, as in a GPU job): the gloo side group that
    cpu_group() creates (its timeout) and the data-failure agreement of the last rank over it."""
    import torch.distributed as dist

    from embodyhpc.train import preempt
    from embodyhpc.train.stream import agree_on_failure

    real_get_backend, real_new_group, real_all_reduce = dist.get_backend, dist.new_group, dist.all_reduce
    timeouts: list[float] = []
    reduced_on: list[Any] = []

    def new_group(*args, **kwargs):
        timeouts.append(kwargs["timeout"].total_seconds())
        return real_new_group(*args, **kwargs)

    def all_reduce(tensor, *args, group=None, **kwargs):
        reduced_on.append(group)
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    dist.get_backend = lambda group=None: "nccl" if group in (None, dist.group.WORLD) else real_get_backend(group)
    dist.new_group, dist.all_reduce = new_group, all_reduce
    try:
        side = preempt.cpu_group()
        mine = DataWorkerError(f"rank {rank}: data worker 0 failed reading sample 9: OSError: gone") \
            if rank == world_size - 1 else None
        agreed = agree_on_failure(mine, side)
        none_failed = agree_on_failure(None, side)
    finally:
        dist.get_backend, dist.new_group, dist.all_reduce = real_get_backend, real_new_group, real_all_reduce
    return {"timeouts": timeouts, "agreed": str(agreed), "same_object": agreed is mine, "none_failed": none_failed,
            "on_side_group": all(group is side for group in reduced_on) and len(reduced_on) == 2}
