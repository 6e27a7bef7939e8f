"""FSDP2 on 2 gloo ranks (one spawned group for all scenarios: rank start-up dominates on 2 cores): fp32 equals
an unsharded single-process reference, activation checkpointing changes nothing, bf16 stays close, inference
through the registered sample_actions works, and the mesh refuses degrees the world does not have."""

from __future__ import annotations

import pytest
import torch

from tests.parallel import workers
from tests.parallel.harness import run_ranks
from tests.parallel.workers import assemble

LOSS_ATOL = 5e-6  # fp32 over 3 AdamW steps (measured: <= 1.2e-7; the data-parallel sums round differently)
GRAD_ATOL = 1e-6  # measured 6e-8
PARAM_ATOL = 5e-5  # AdamW divides by sqrt(v): tiny gradient differences move near-zero-gradient weights by ~lr*1e-3
BF16_LOSS_RTOL = 1e-2  # bf16 parameters and activations, fp32 reduce (measured: <= 3e-4 relative)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(workers.fsdp_scenarios, 2)


def test_fp32_fsdp_matches_the_unsharded_reference(ranks) -> None:
    reference, sharded = ranks[0]["reference"], ranks[0]["fp32"]
    init = assemble([rank["fp32"]["init"] for rank in ranks])
    assert init.keys() == ranks[0]["reference_init"].keys()
    for name, value in ranks[0]["reference_init"].items():  # materialize == unsharded init from the same seed
        assert torch.equal(init[name], value), name
    assert ranks[1]["fp32"]["losses"] == sharded["losses"]
    assert sharded["losses"] == pytest.approx(reference["losses"], rel=0, abs=LOSS_ATOL)
    grads = assemble([rank["fp32"]["grads"] for rank in ranks])
    assert grads.keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=GRAD_ATOL, msg=name)
    params = assemble([rank["fp32"]["params"] for rank in ranks])
    for name, param in reference["params"].items():
        torch.testing.assert_close(params[name], param, rtol=0, atol=PARAM_ATOL, msg=name)


@pytest.mark.parametrize("mode", ["ac_full", "ac_every_k"])
def test_activation_checkpointing_gives_identical_losses_and_gradients(ranks, mode: str) -> None:
    assert ranks[0][mode]["plan"].ac_units  # it really wrapped blocks
    for rank in ranks:
        assert rank[mode]["losses"] == rank["fp32"]["losses"]
        for key in ("grads", "params"):
            for name, value in rank["fp32"][key].items():
                assert torch.equal(rank[mode][key][name], value), (key, name)


def test_bf16_mixed_precision_trains_close_to_fp32(ranks) -> None:
    plan = ranks[0]["bf16"]["plan"]
    assert (plan.param_dtype, plan.reduce_dtype) == ("bfloat16", "float32")
    assert ranks[0]["bf16"]["losses"] == pytest.approx(ranks[0]["reference"]["losses"], rel=BF16_LOSS_RTOL)
    assert ranks[0]["bf16"]["losses"] != ranks[0]["fp32"]["losses"]  # it did compute in bf16


def test_sample_actions_runs_sharded_like_the_unsharded_model(ranks) -> None:
    actions = torch.cat([rank["sample_actions"] for rank in ranks])  # each rank sampled its 2 of the 4 samples
    torch.testing.assert_close(actions, ranks[0]["reference_sample_actions"], rtol=0, atol=1e-5)


def test_mesh_and_plan_refuse_degrees_the_running_world_does_not_have(ranks) -> None:
    wrong_size, split_node, wrong_config, foreign_mesh = ranks[0]["errors"]
    assert wrong_size.startswith("ConfigError: parallelism.dp_shard: dp_replicate x dp_shard does not match the "
                                 "running world size: parallelism.dp_replicate=1, parallelism.dp_shard=4")
    assert "world_size=2" in wrong_size and "fix:" in wrong_size
    assert "HSDP shard groups of 1 consecutive ranks would split nodes of 2 processes" in split_node
    assert wrong_config.startswith("ValueError: the mesh (dp_replicate=1, dp_shard=2) was not built from this "
                                   "parallelism section (dp_replicate=2, dp_shard=-1)")
    assert foreign_mesh.startswith("ValueError: expected a mesh with dims ('dp_shard',) or ('dp_replicate', "
                                   "'dp_shard') from embodyhpc.parallel.build_mesh, got ('dp',)")
