"""Weight sync on gloo: after a sync every rollout worker's trainable weights equal the actor's bit for bit, only
trainable parameters travel (bytes counted against the model), the swap happens only at swap_if_ready, and a
sender that dies or stays silent ends the receiver within its bound."""

from __future__ import annotations

import os
import queue
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from embodyhpc.environ import patched_environ
from embodyhpc.errors import RunFailure
from embodyhpc.rl.endpoints import free_port
from embodyhpc.rl.transport import PeerTimeout
from embodyhpc.rl.weight_sync import (
    WeightReceiver,
    WeightSender,
    clean_name,
    standalone_group,
    sync_group,
    trainable_state,
)

_CHILD_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


class Policy(nn.Module):
    """A stand-in with a frozen part (the "VLM") and two dtypes among its trainable parameters."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.vlm = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.scale = nn.Parameter(torch.randn(5, dtype=torch.float64))
        self.vlm.requires_grad_(False)


def _run(fn, world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` gloo ranks (forkserver children); what each rank returned (None
    for a rank that died). A rank that dies does not hang the others' teardown: ranks leave with os._exit."""
    with tempfile.TemporaryDirectory(prefix="embodyhpc-sync-") as folder:
        with patched_environ(_CHILD_ENV):
            mp.get_context("forkserver").set_forkserver_preload([__name__])
            context = mp.start_processes(_rank, args=(fn, world_size, folder, args), nprocs=world_size, join=False,
                                         start_method="forkserver")
        deadline = time.monotonic() + timeout_s
        while any(p.is_alive() for p in context.processes):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise AssertionError(f"ranks of {fn.__name__} still running after {timeout_s:.0f} s")
            time.sleep(0.05)
        return [torch.load(path, weights_only=False) if (path := Path(folder) / f"rank{r}.pt").exists() else None
                for r in range(world_size)]


def _rank(rank: int, fn, world_size: int, folder: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(_CHILD_ENV)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))
    result = fn(rank, world_size, *args)
    torch.save(result, Path(folder) / f"rank{rank}.pt")
    os._exit(0)  # no teardown collective: a test may have killed a peer on purpose


def _sync(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    group = sync_group(0, range(1, world_size), timeout_s=30)
    model = Policy(seed=rank)  # every rank starts from different weights
    out: dict[str, Any] = {"initial": {k: v.clone() for k, v in model.state_dict().items()}, "versions": []}
    if rank == 0:
        sender = WeightSender(group, 0, timeout_s=20)
        for version in (1, 2):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.125 * version)  # an optimizer step, frozen part included (it must not travel)
            dist.barrier()  # the receivers have checked that nothing moved before this version's swap
            out["bytes"] = sender.send(trainable_state(model), version)
            out["versions"].append({k: v.clone() for k, v in model.state_dict().items()})
            dist.barrier()
        sender.close()
        out["bytes_sent"] = sender.bytes_sent
        return out
    receiver = WeightReceiver(model, group, 0, timeout_s=20).start()
    for _ in (1, 2):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        dist.barrier()
        assert receiver.wait_ready(timeout_s=20)
        out.setdefault("unchanged_while_staged", []).append(
            all(torch.equal(model.state_dict()[k], v) for k, v in before.items()))
        out["versions"].append((receiver.swap_if_ready(), {k: v.clone() for k, v in model.state_dict().items()}))
        assert receiver.swap_if_ready() is None  # swapped once
        dist.barrier()
    receiver.join(20)
    out["finished"] = receiver.finished
    out["bytes_received"] = receiver.bytes_received
    return out


def test_trainable_state_leaves_frozen_parameters_out() -> None:
    model = Policy(seed=0)
    state = trainable_state(model)
    assert sorted(state) == ["head.bias", "head.weight", "scale"]
    assert all(torch.equal(state[name], param) for name, param in model.named_parameters() if name in state)


class _Group:
    """A stand-in for a ProcessGroup: the sender's broadcasts are copied into every receiver's queue, a receiver takes
    the next one (a gloo-like timeout if none comes)."""

    def __init__(self, queues: list[queue.Queue], sends: bool) -> None:
        self.queues, self.sends = queues, sends

    def broadcast(self, tensors: list[torch.Tensor], options) -> _Work:
        assert options.rootRank == 0 and len(tensors) == 1
        return _Work(tensors[0], self)


class _Work:
    def __init__(self, tensor: torch.Tensor, group: _Group) -> None:
        self.tensor, self.group = tensor, group

    def wait(self, timeout: timedelta) -> None:
        if self.group.sends:
            for q in self.group.queues:
                q.put(self.tensor.clone())
            return
        try:
            self.tensor.copy_(self.group.queues[0].get(timeout=timeout.total_seconds()))
        except queue.Empty:
            raise RuntimeError("[gloo] Operation timed out!") from None


def test_only_trainable_weights_travel_and_land_at_the_swap() -> None:
    """The packing (one buffer per dtype) and the swap, through a broadcast double (the gloo test below runs the
    real one): bit-exact trainable weights, frozen ones untouched, bytes = the trainable parameters' bytes."""
    compiled = nn.Module()
    compiled._orig_mod = actor = Policy(seed=0)  # the actor's parameters as torch.compile names them
    rollouts = [Policy(seed=1), Policy(seed=2)]
    assert clean_name("layers.0._checkpoint_wrapped_module.mlp.weight") == "layers.0.mlp.weight"
    initial = [{k: v.clone() for k, v in m.state_dict().items()} for m in rollouts]
    queues = [queue.Queue() for _ in rollouts]
    receivers = [WeightReceiver(m, _Group([q], False), 0, timeout_s=10).start() for m, q in zip(rollouts, queues,
                                                                                                   strict=True)]
    with torch.no_grad():
        for param in actor.parameters():
            param.add_(0.5)
    state = trainable_state(compiled)
    assert sorted(state) == ["_orig_mod.head.bias", "_orig_mod.head.weight", "_orig_mod.scale"]
    sent = WeightSender(_Group(queues, True), 0).send(state, version=1)
    expected = sum(p.numel() * p.element_size() for p in actor.parameters() if p.requires_grad)
    assert sent == expected == (16 * 3 + 3) * 4 + 5 * 8  # float32 head + float64 scale; the frozen vlm not sent
    for model, receiver, before in zip(rollouts, receivers, initial, strict=True):
        assert receiver.wait_ready(timeout_s=10)
        assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items()), "swapped before the boundary"
        assert receiver.swap_if_ready() == 1 and receiver.swap_if_ready() is None
        for name, param in model.named_parameters():
            reference = dict(actor.named_parameters())[name] if param.requires_grad else before[name]
            assert param.dtype == reference.dtype and torch.equal(param, reference), name
    with pytest.raises(PeerTimeout, match="actor rank 0 sent no weights for 0.2 s"):
        WeightReceiver(Policy(seed=3), _Group([queue.Queue()], False), 0, timeout_s=0.2).start().wait_ready(5)


@pytest.mark.slow
def test_every_rollout_worker_gets_the_actors_trainable_weights_at_its_swap() -> None:
    actor, *rollouts = _run(_sync, 3)
    model = Policy(seed=0)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    # the bytes of the trainable parameters, counted from the model (float32 head, float64 scale), frozen left out
    expected = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert expected == (16 * 3 + 3) * 4 + 5 * 8
    assert actor["bytes"] == expected and actor["bytes_sent"] == 2 * expected
    for rank, rollout in enumerate(rollouts, start=1):
        assert rollout["unchanged_while_staged"] == [True, True], rank
        assert rollout["bytes_received"] == 2 * expected and rollout["finished"]
        for index, (version, weights) in enumerate(rollout["versions"]):
            assert version == index + 1
            sent = actor["versions"][index]
            for name in trainable:
                assert weights[name].dtype == sent[name].dtype and torch.equal(weights[name], sent[name]), name
            for name in frozen:  # never sent: the rollout worker keeps its own
                assert torch.equal(weights[name], rollout["initial"][name]), name
                assert not torch.equal(weights[name], sent[name]), name


def _silent_or_dead(rank: int, world_size: int, mode: str, port: int) -> dict:
    """On a group of its own (standalone_group) beside the ranks' world, as the roles run it."""
    group = standalone_group("127.0.0.1", port, rank, world_size, timeout_s=30)
    group.barrier().wait()  # the group is connected on both sides before the actor goes
    if rank == 0:
        if mode == "dies":
            os._exit(3)  # the actor crashes before its first sync
        time.sleep(1.0)  # alive but silent, past the receiver's bound
        return {}
    receiver = WeightReceiver(Policy(seed=1), group, 0, timeout_s=0.5).start()
    start = time.monotonic()
    try:
        receiver.wait_ready(timeout_s=20)
    except (PeerTimeout, RunFailure) as exc:
        return {"error": type(exc).__name__, "message": str(exc), "after_s": time.monotonic() - start}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["silent", "dies"])
def test_a_silent_or_dead_sender_ends_the_receiver_within_its_bound(mode) -> None:
    _, got = _run(_silent_or_dead, 2, mode, free_port("127.0.0.1"))
    if mode == "silent":
        assert got["error"] == "PeerTimeout" and got["message"].startswith("actor rank 0 sent no weights for 0.5 s")
        assert got["after_s"] >= 0.5
    else:
        assert got["error"] in ("RunFailure", "PeerTimeout") and "actor rank 0" in got["message"], got
    assert got["after_s"] < 15  # well inside wait_ready's 20 s: the receiver's own bound ended it


def test_a_rollout_loop_that_never_swaps_ends_the_receiver_within_its_bound() -> None:
    """The receiving thread waits for the staged version to be swapped in before it takes the next: bounded by
    timeout_s, then swap_if_ready raises why (a stuck rollout loop never holds the job forever)."""
    actor, rollout, q = Policy(seed=0), Policy(seed=1), queue.Queue()
    receiver = WeightReceiver(rollout, _Group([q], False), 0, timeout_s=0.3).start()
    sender = WeightSender(_Group([q], True), 0)
    sender.send(trainable_state(actor), version=1)
    assert receiver.wait_ready(timeout_s=10)
    sender.send(trainable_state(actor), version=2)  # version 1 never swapped in
    deadline = time.monotonic() + 10
    while receiver._error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RunFailure, match="did not swap in version 1 for 0 s"):
        receiver.swap_if_ready()


def test_drain_takes_the_last_version_and_the_goodbye_so_the_receiver_ends() -> None:
    """The rollout loop ends at rl.iterations while the actor still broadcasts its last version and its goodbye:
    drain takes part in both (the last version dropped unused) and returns once the receiving thread has ended, long
    before the receiver's own bound. A process that exits with that thread inside a collective aborts, and the
    aborted rollout worker failed the whole Slurm job (tests/slurm/test_rl_job.py)."""
    actor, rollout, q = Policy(seed=0), Policy(seed=1), queue.Queue()
    receiver = WeightReceiver(rollout, _Group([q], False), 0, timeout_s=30).start()
    sender = WeightSender(_Group([q], True), 0)
    sender.send(trainable_state(actor), version=1)
    assert receiver.wait_ready(timeout_s=10) and receiver.swap_if_ready() == 1
    sender.send(trainable_state(actor), version=2)  # the last version: the loop is done and never swaps it in
    sender.close()
    start = time.monotonic()
    receiver.drain(timeout_s=10)
    assert not receiver._thread.is_alive() and receiver._finished
    assert time.monotonic() - start < 10


def test_drain_without_a_goodbye_ends_within_its_bound() -> None:
    rollout, q = Policy(seed=1), queue.Queue()
    receiver = WeightReceiver(rollout, _Group([q], False), 0, timeout_s=30).start()
    with pytest.raises(PeerTimeout, match="sent no goodbye"):
        receiver.drain(timeout_s=0.3)
