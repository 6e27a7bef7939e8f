"""Run a function on N local gloo ranks (torch.multiprocessing processes) and collect what each rank returns.

Ranks are forked from a fork server rather than spawned: the server is a fresh interpreter (like spawn: no
threads, no process group, nothing inherited from pytest) that imports torch and the worker module once per test
session; spawning imports them again in every rank, ~8 s per group on this loaded 2-core machine against ~1 s.
Each rank joins through a file:// rendezvous in a fresh folder (no port to race for), runs single-threaded (the CI
machine has 2 shared cores; intra-op threads of several ranks fight each other and run 10x slower), returns a
picklable value, and all ranks meet at a barrier before tearing the group down (FACTS: gloo ranks occasionally
abort at exit otherwise). A rank that hangs fails the test after `timeout_s` instead of hanging the suite.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from embodyhpc.environ import patched_environ

_CHILD_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TORCHINDUCTOR_COMPILE_THREADS": "1",
              "TORCHINDUCTOR_CACHE_DIR": str(Path(__file__).resolve().parents[2] / ".cache" / "inductor")}
# imported once by the fork server when installed (an ImportError there is ignored): torchao takes seconds
_OPTIONAL_PRELOAD = ("torchao.float8",)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 90.0) -> list[Any]:
    """[fn(rank, world_size, *args) for each rank], each run in its own process inside one gloo group."""
    with tempfile.TemporaryDirectory(prefix="embodyhpc-ranks-") as folder:
        with patched_environ(_CHILD_ENV):  # children inherit the environment at start
            # forkserver: the server imports torch and the worker modules once per test session, then forks a clean
            # child per rank (no threads, no process group in the server), which saves the ~4 s import of every
            # spawned rank on this 2-core machine
            mp.get_context("forkserver").set_forkserver_preload([fn.__module__, *_OPTIONAL_PRELOAD])
            context = mp.start_processes(_rank_main, args=(fn, world_size, folder, args, _CHILD_ENV), nprocs=world_size,
                                         join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):  # raises ProcessRaisedException with the rank's traceback
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise AssertionError(f"{world_size} ranks of {fn.__name__} still running after {timeout_s:.0f} s")
        return [torch.load(Path(folder) / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, folder: str, args: tuple,
               env: dict[str, str]) -> None:
    import torch.distributed as dist

    # again here: a fork server another test module started first has that module's environment, not ours
    os.environ.update(env)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(folder) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()
