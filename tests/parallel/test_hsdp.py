"""HSDP on 4 gloo ranks as 2 nodes x 2 processes (degrees from resolve()): shard groups are a node's consecutive
ranks, parameters are (Replicate, Shard(0)), and training equals the unsharded reference."""

from __future__ import annotations

import pytest
import torch

from tests.parallel import workers
from tests.parallel.harness import run_ranks
from tests.parallel.test_fsdp import LOSS_ATOL, PARAM_ATOL
from tests.parallel.workers import assemble


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(workers.hsdp_scenario, 4)


def test_shard_groups_are_the_ranks_of_one_node(ranks) -> None:
    assert [rank["shard_group"] for rank in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(rank["placements"] == ["R", "S(0)"] for rank in ranks)
    assert ranks[0]["plan"].summary().startswith("HSDP dp_replicate=2 dp_shard=2;")


def test_hsdp_matches_the_unsharded_reference(ranks) -> None:
    reference = ranks[0]["reference"]
    assert all(rank["losses"] == ranks[0]["losses"] for rank in ranks)
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=0, abs=LOSS_ATOL)
    replicas = [assemble([ranks[0]["params"], ranks[1]["params"]]), assemble([ranks[2]["params"], ranks[3]["params"]])]
    for name, param in reference["params"].items():
        assert torch.equal(replicas[0][name], replicas[1][name]), name  # the replicas stay identical
        torch.testing.assert_close(replicas[0][name], param, rtol=0, atol=PARAM_ATOL, msg=name)
