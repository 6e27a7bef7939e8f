"""FSDP2 on 2 gloo ranks: how a sharded model is initialised, and what its layers receive.

Initialisation: one materialize path on every device (embodyhpc.models.init rules, a full-size tensor per parameter,
each rank keeping its slice), so the sharded result equals the unsharded initialisation from the same seed. It
used to initialise DTensor shards in place on GPUs, where a slice assignment such as the adaRMS gate's
`bias[2*dim:] = 1` writes into a redistributed temporary: the gate started at 0 on GPUs and 1 on CPU.

Inputs: FSDP2's cast_forward_inputs recursed into dataclasses (torch 2.13's _apply_to_tensors), rounding the
flow-matching target to bf16 and handing every layer a copy of the token plan, whose cached attention plans were
rebuilt in every layer.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel import workers
from tests.parallel.harness import run_ranks
from tests.parallel.workers import assemble


@pytest.fixture(scope="module")
def init_ranks() -> list[dict]:
    return run_ranks(workers.init_scenario, 2)


def test_sharded_init_equals_the_unsharded_init_and_leaves_no_nan(init_ranks) -> None:
    reference = init_ranks[0]["reference"]
    sharded = assemble([rank["params"] for rank in init_ranks])
    assert sharded.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.isfinite(sharded[name]).all(), name
        assert torch.equal(sharded[name], value), name


def test_the_adarms_gate_is_one_on_every_shard(init_ranks) -> None:
    sharded = assemble([rank["params"] for rank in init_ranks])
    gated = [name for name in sharded if name.endswith("attn_norm.modulation.bias") and ".expert." in name]
    assert gated
    for name in gated:
        bias = sharded[name]
        dim = bias.numel() // 3
        assert torch.equal(bias[2 * dim:], torch.ones(dim)) and torch.equal(bias[:2 * dim], torch.zeros(2 * dim))


def test_random_weights_differ_between_shards_and_have_the_rule_statistics(init_ranks) -> None:
    for name in ("layers.0.vlm.q_proj.weight", "embed_tokens.weight", "layers.1.expert.mlp.up_proj.weight"):
        first, second = (rank["params"][name] for rank in init_ranks)
        assert not torch.equal(first[:len(second)], second[:len(first)]), name  # not copies of one draw
        full = torch.cat([first, second])
        assert full.mean().item() == pytest.approx(0.0, abs=2e-3) and full.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.fixture(scope="module")
def input_ranks() -> list[dict]:
    return run_ranks(workers.fsdp_inputs_scenario, 2)


def test_the_flow_matching_target_reaches_the_model_in_float32_unrounded(input_ranks) -> None:
    for rank in input_ranks:
        (actions,) = rank["actions"]
        assert actions.dtype == torch.float32
        assert torch.equal(actions, rank["given_actions"])


def test_plans_are_built_once_per_pass_and_every_layer_gets_the_same_ones(input_ranks) -> None:
    for rank in input_ranks:
        assert rank["plans"] == 1  # the token plan of the one training forward
        assert rank["prepares"] == 2  # attention planned for the joint and the suffix layouts, once each
        assert len(rank["shared"]) == rank["num_layers"] and len(set(rank["shared"])) == 1  # not copied per layer
        assert set(rank["rope_dtypes"]) == {"torch.float32"}  # rotary angles not cast to bf16 on the way
