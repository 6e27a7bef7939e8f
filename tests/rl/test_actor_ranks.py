"""Two FSDP2 actor ranks (gloo) and a rollout worker: after a sync, the rollout worker's trainable weights are the
actor ranks' shards put together, each rank's rows where FSDP2 placed them (dim 0, torch.chunk's split), checked
against the shards each rank held and against a formula; the frozen part never travels. This is the actor's own
sequence (actor.Actor._send): trainable_state on every actor rank (a collective under FSDP2), then rank 0 sends.
And the other actor ranks' wait for rank 0 during a long but live round (Actor._collect's keep-alive)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import embodyhpc.rl.actor as actor_module
from embodyhpc.rl.actor import KEEPALIVE, Actor
from embodyhpc.rl.assembly import Window
from embodyhpc.rl.weight_sync import WeightReceiver, WeightSender, sync_group, trainable_state
from tests.rl.test_weight_sync import _run

ROWS = 5  # uneven over 2 ranks: rank 0 holds rows 0..2, rank 1 rows 3..4


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.vlm = nn.Linear(8, 8)
        self.head = nn.Linear(8, ROWS)
        self.scale = nn.Parameter(torch.randn(7))
        self.vlm.requires_grad_(False)


def _actor_ranks_and_a_rollout(rank: int, world_size: int) -> dict:
    """Ranks 0 and 1: the actor (a world of their own for FSDP2); rank 2: a rollout worker."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    actor = dist.new_group([0, 1])
    weights = sync_group(0, [2], timeout_s=30)
    if rank < 2:
        mesh = DeviceMesh.from_group(actor, "cpu")
        model = Net(seed=0)
        fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        with torch.no_grad():  # each rank changes only the rows it holds: a shard left out cannot pass unseen
            for param in model.parameters():
                param.to_local().add_(rank + 1)
        shards = {name: param.to_local().clone() for name, param in model.named_parameters()}
        state = trainable_state(model)  # every actor rank: the gather is a collective
        if rank == 0:
            sender = WeightSender(weights, 0, timeout_s=20)
            sender.send(state, 1)
            sender.close()
        return {"shards": shards}
    model = Net(seed=1)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    receiver = WeightReceiver(model, weights, 0, timeout_s=20).start()
    assert receiver.wait_ready(timeout_s=20)
    version = receiver.swap_if_ready()
    receiver.drain(timeout_s=20)
    return {"version": version, "weights": {k: v.clone() for k, v in model.state_dict().items()}, "initial": initial}


@pytest.mark.slow  # three gloo processes (~4 s); the gather-free parts: tests/rl/test_weight_sync.py
def test_the_rollout_worker_gets_both_actor_ranks_shards_put_together() -> None:
    rank0, rank1, rollout = _run(_actor_ranks_and_a_rollout, 3)
    assert rollout is not None and rank0 is not None and rank1 is not None, "a rank died: see its stderr"
    assert rollout["version"] == 1
    start = Net(seed=0)
    for name, param in start.named_parameters():
        received = rollout["weights"][name]
        if not param.requires_grad:  # never sent: the rollout worker keeps its own
            assert torch.equal(received, rollout["initial"][name]), name
            continue
        split = math.ceil(param.shape[0] / 2)  # torch.chunk over 2 ranks: FSDP2's dim-0 shards
        assert rank0["shards"][name].shape[0] == split and rank1["shards"][name].shape[0] == param.shape[0] - split
        assert torch.equal(received, torch.cat([rank0["shards"][name], rank1["shards"][name]])), name
        expected = param.detach().clone()
        expected[:split] += 1.0  # rank 0's rows
        expected[split:] += 2.0  # rank 1's rows
        assert torch.equal(received, expected), name


GROUP_TIMEOUT_S = 2.0  # the actor ranks' collective bound in this test (a cluster's: max(rl.peer_timeout_s, 60))
ROUND_S = 3 * GROUP_TIMEOUT_S  # rank 0 collects a round this long, hearing from its rollouts all the while


def _long_live_round(rank: int, world_size: int) -> dict:
    """Two actor ranks in Actor._collect's real code: rank 0 pulls a synchronous round that lasts ROUND_S (its
    rollouts are alive: a message every 50 ms) before the round's one episode ends; rank 1 waits for it in the
    broadcast, on a group whose collectives time out after GROUP_TIMEOUT_S."""
    from datetime import timedelta

    import numpy as np
    import torch.distributed as dist

    from embodyhpc.rl.assembly import Episode
    from embodyhpc.rl.samples import ChunkSample, EpisodeEnd, StalenessGate, VersionCounter

    actor = Actor.__new__(Actor)  # the collect loop alone: no model
    actor.rank, actor.world = rank, world_size
    actor.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    actor.rl = SimpleNamespace(async_=False, algorithm="grpo", micro_batch_size=1, episodes_per_iteration=1,
                               peer_timeout_s=GROUP_TIMEOUT_S)
    actor.config = SimpleNamespace(train=SimpleNamespace(global_batch_size=1))
    actor.gate, actor.version, actor.critic = StalenessGate(1), VersionCounter(0), None
    started = time.monotonic()

    class Puller:  # the rollouts stream pieces all round long
        def pull_many(self, most: int, timeout_s: float) -> list:
            time.sleep(0.05)
            return ["piece"]

    class Assembler:  # the round's one episode ends after ROUND_S
        def take(self, message) -> None:
            pass

        def complete_groups(self) -> list:
            if time.monotonic() - started < ROUND_S or getattr(self, "done", False):
                return []
            self.done = True
            sample = ChunkSample(env_id=0, episode_id=0, group_id=0, chunk_index=0, observation={},
                                 trajectory=np.zeros((2, 1, 1), np.float32), log_prob=np.zeros((1, 1, 1), np.float32),
                                 version=0)
            return [[Episode(samples={0: sample}, end=EpisodeEnd(env_id=0, episode_id=0, group_id=0, success=True,
                                                                  episode_return=1.0, length=1, version=0))]]

    box = actor._collect(Puller(), Assembler(), [], Window())
    return {"box": box, "waited_s": time.monotonic() - started}


@pytest.mark.slow  # two gloo processes and a round of 3 x the group's timeout (~8 s)
def test_a_long_live_round_does_not_time_out_the_other_actor_ranks() -> None:
    """Issue 31's keep-alive: the other actor ranks wait for rank 0 in a collective bounded by the group's timeout
    (never unbounded); a round longer than that, with rank 0 alive and pulling, must not end their wait (rank 0
    keeps them alive every min(KEEPALIVE_S, rl.peer_timeout_s / 4)): both ranks get the round's step."""
    rank0, rank1 = _run(_long_live_round, 2, timeout_s=60)
    assert rank1 is not None, "actor rank 1 died waiting for rank 0's round (its collective timed out): see stderr"
    assert rank0 is not None
    assert rank0["box"] == rank1["box"] == ("step", [])  # one episode, a group of one: no gradient, but the step
    assert rank1["waited_s"] >= ROUND_S > GROUP_TIMEOUT_S  # it really waited longer than one collective's bound


def test_keepalives_then_the_round_in_both_directions(monkeypatch) -> None:
    """The keep-alive protocol in one process (the broadcast recorded, no second rank): rank 0 broadcasts KEEPALIVE
    while it collects, at least once per keep-alive period, and the round's box last; another rank returns the
    first box that is not a keep-alive. Periods are counted in pulls here (each pull outlasts the period)."""
    sent: list = []
    monkeypatch.setattr(actor_module.dist, "broadcast_object_list", lambda box, src, group: sent.append(box[0]))

    class Quiet:  # the stop signal rank 0 looks at while it waits for samples: it arrives after 5 pulls
        pulls = 0

        @property
        def received(self):
            return SimpleNamespace(name="SIGUSR2") if self.pulls >= 5 else None

    stop = Quiet()

    class Puller:
        def pull_many(self, most: int, timeout_s: float) -> list:
            stop.pulls += 1
            time.sleep(0.01)
            return []

    class Assembler:
        def complete_groups(self) -> list:
            return []

    actor = Actor.__new__(Actor)
    actor.rank, actor.world, actor.group = 0, 2, None
    actor.rl = SimpleNamespace(async_=False, micro_batch_size=1, episodes_per_iteration=1, peer_timeout_s=0.004)
    actor.config = SimpleNamespace(train=SimpleNamespace(global_batch_size=1))
    assert actor._collect(Puller(), Assembler(), [], Window(), stop) == "SIGUSR2"
    assert sent[-1] == "SIGUSR2" and len(sent) >= 5 and set(sent[:-1]) == {KEEPALIVE}  # one per pull, then the box

    incoming = iter([KEEPALIVE, KEEPALIVE, ("step", [])])
    monkeypatch.setattr(actor_module.dist, "broadcast_object_list",
                        lambda box, src, group: box.__setitem__(0, next(incoming)))
    actor.rank = 1
    assert actor._collect(None, None, [], Window()) == ("step", [])
    assert next(incoming, "drained") == "drained"  # it read every broadcast up to the round's
