"""Run a function on N gloo ranks (torch.multiprocessing, a file rendezvous), and the shared pieces the rank
jobs use: the tiny pi0.5 sharded with FSDP2 the way parallel/ will do it (each declared unit, then the root),
a deterministic toy dataset and sampler, and comparison of nested state dicts.

Not a test module (no test_ prefix): the ranks import it by name, so everything they run lives at top level.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import random
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model, build_tokenizer
from embodyhpc.models.pi05 import Pi05Batch, Pi05Sample, collate, max_prompt_tokens

MODEL_CFG = ModelConfig(size="tiny", action_horizon=8, action_dim=8, max_token_len=160)
NUM_CAMERAS, NUM_SAMPLES, BATCH_PER_RANK = 1, 48, 2
INSTRUCTIONS = ["pick up the cup", "open the drawer", "push the block left", "close it"]


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any, timeout_s: float = 600.0) -> None:
    """fn(rank, world_size, *args) on every rank; raises if any rank fails, or if they are still running after
    `timeout_s` (a bound for a loaded 2-core machine, not a speed).

    Ranks are forked from a forkserver that imported torch, DCP and the tiny model once (the first call pays it):
    a fresh interpreter per rank spends ~5 s of CPU importing them, 3 ranks on 2 cores ~15 s per job.
    The forkserver is a clean single-threaded process, so forking it is safe where forking pytest is not. The ranks
    meet through a file in a folder of their own (no TCP port another test could take in the meantime).
    """
    os.environ["OMP_NUM_THREADS"] = "1"  # 2 shared cores: intra-op threads of several ranks fight
    multiprocessing.set_forkserver_preload(["torch._dynamo", "tests.checkpoint.jobs"])
    with tempfile.TemporaryDirectory(prefix="embodyhpc-ckpt-ranks-") as folder:
        context = mp.start_processes(_rank_main, args=(fn, world_size, f"file://{folder}/rendezvous", args),
                                     nprocs=world_size, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):  # raises ProcessRaisedException with the failed rank's traceback
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                raise AssertionError(f"{world_size} ranks of {fn.__name__} still running after {timeout_s:.0f} s")


def _rank_main(rank: int, fn: Callable[..., None], world_size: int, init_method: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=90))
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # FACTS: gloo ranks may abort at exit without one
    finally:
        dist.destroy_process_group()


# ---- model ----
def sharded_model(init_seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The tiny pi0.5, identical on every rank before sharding (FSDP2 shards each rank's full copy)."""
    torch.manual_seed(init_seed)
    model = build_model(MODEL_CFG)
    if dist.is_initialized():
        for unit in model.fsdp_units():
            fully_shard(unit)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    return model, optimizer


def scheduler_for(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


# ---- data ----
class ToySampler:
    """Deterministic step sampler: a per-epoch permutation dealt to ranks; state = (epoch, position)."""

    def __init__(self, rank: int, world_size: int, seed: int = 7) -> None:
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.position = 0, 0

    def next_indices(self) -> list[int]:
        per_step = BATCH_PER_RANK * self.world_size
        if self.position + per_step > NUM_SAMPLES:
            self.epoch, self.position = self.epoch + 1, 0
        order = np.random.default_rng(self.seed * 1000 + self.epoch).permutation(NUM_SAMPLES)
        chunk = order[self.position:self.position + per_step]
        self.position += per_step
        return chunk[self.rank::self.world_size].tolist()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def make_batch(indices: list[int]) -> Pi05Batch:
    """Samples are a function of their index; augmentation draws from Python's and NumPy's global RNGs, and the
    model draws its flow-matching noise from torch's: resume is exact only if all three are restored."""
    samples = []
    for index in indices:
        g = torch.Generator().manual_seed(index)
        state = torch.rand(6, generator=g) * 2 - 1 + torch.from_numpy(np.random.normal(0, 0.05, 6)).float()
        samples.append(Pi05Sample(images=torch.rand(NUM_CAMERAS, 3, 32, 32, generator=g),
                                  instruction=random.choice(INSTRUCTIONS), state=state.clamp(-1, 1),
                                  actions=torch.randn(8, 8, generator=g)))
    return collate(samples, _tokenizer(), max_prompt_tokens=max_prompt_tokens(MODEL_CFG, NUM_CAMERAS))


@functools.cache
def _tokenizer():
    return build_tokenizer(MODEL_CFG)


def train_step(model, optimizer, scheduler, sampler: ToySampler) -> float:
    """One optimizer step; returns the loss averaged over ranks (the same float on every rank)."""
    loss = model(make_batch(sampler.next_indices())).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if scheduler is not None:
        scheduler.step()
    value = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value.item())


# ---- state comparison ----
def full_state(model, optimizer) -> dict[str, Any]:
    """Full (unsharded) model and optimizer state on rank 0; collective (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    # On one rank the "full" tensors are the live ones: copy, or the next step changes what was captured.
    return _cloned({"model": model_state, "optim": optim_state})


def _cloned(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _cloned(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_cloned(value) for value in tree)
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}/"))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, value in enumerate(tree):
            out.update(flatten(value, f"{prefix}{i}/"))
        return out
    return {prefix.rstrip("/"): tree}


def differences(expected: Any, actual: Any) -> list[str]:
    """Keys whose values are not identical (torch.equal and same dtype for tensors), plus missing/extra keys."""
    want, got = flatten(expected), flatten(actual)
    problems = [f"missing {k}" for k in want.keys() - got.keys()] + [f"extra {k}" for k in got.keys() - want.keys()]
    for key in want.keys() & got.keys():
        a, b = want[key], got[key]
        if isinstance(a, torch.Tensor):
            if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or not torch.equal(a, b):
                problems.append(f"differs {key}")
        elif a != b:
            problems.append(f"differs {key}: {a!r} != {b!r}")
    return sorted(problems)
