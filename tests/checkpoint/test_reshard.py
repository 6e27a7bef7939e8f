"""Save on 2 ranks, load on 1 and on 3 (uneven shards): every parameter and optimizer tensor is bit-identical."""

from __future__ import annotations

import pytest
import torch

from tests.checkpoint import jobs
from tests.checkpoint.distributed import differences, run_ranks


@pytest.mark.parametrize("world_size", [1, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks on 2 cores: ~3 s
def test_save_on_two_ranks_loads_bit_identical_on(world_size, saved_on_two_ranks):
    run_ranks(jobs.load_job, world_size, str(saved_on_two_ranks))
    expected = torch.load(saved_on_two_ranks / "expected.pt", weights_only=True)
    loaded = torch.load(saved_on_two_ranks / f"loaded_w{world_size}.pt", weights_only=True)

    assert loaded["step"] == 3, "load_latest picks the newest complete step"
    assert loaded["saved_world_size"] == 2
    assert loaded["rng_restored"] is False, "another world size reseeds instead of restoring"
    for step in (2, 3):
        assert differences(expected[step], loaded[step]) == []
        # every parameter gets a gradient (the last layer's prefix stream holds only keys/values), so AdamW has
        # state for each one, and resume restores all of it
        assert len(expected[step]["optim"]["state"]) == len(expected[step]["model"]) > 0
    # step 2 was saved asynchronously while step 3 changed the parameters: the two must differ
    assert differences(expected[2]["model"], expected[3]["model"]) != []
    assert torch.isfinite(torch.tensor(loaded["loss_after"])), "training goes on after the reshard"
