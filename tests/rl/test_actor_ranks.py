"""Two FSDP2 actor ranks (gloo) and a rollout worker: after a sync, the rollout worker's trainable weights are the
actor ranks' shards put together, each rank's rows where FSDP2 placed them (dim 0, torch.chunk's split), checked
against the shards each rank held and against a formula; the frozen part never travels. This is the actor's own
sequence (actor.Actor._send): trainable_state on every actor rank (a collective under FSDP2), then rank 0 sends."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

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
