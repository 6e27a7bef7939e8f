"""What parallel/ and fp8 read from GR00T: its declared FSDP units and the Linear layers that go to float8."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from embodyhpc.config.schema import ModelConfig, ParallelismConfig, PrecisionConfig
from embodyhpc.models import build_model
from embodyhpc.models.fp8 import count_fp8_linears, fp8_filter_for
from embodyhpc.parallel import declared_units, make_plan
from tests.helpers import require
from tests.models.test_groot import make_batch

CFG = ModelConfig(name="groot", size="tiny", action_horizon=16, action_dim=4, max_token_len=96)


def test_units_are_every_block_the_embedding_and_the_action_encoder():
    with torch.device("meta"):
        model = build_model(CFG)
    names = [name for name, _ in declared_units(model)]
    assert names == ["backbone.vision.blocks.0", "backbone.vision.blocks.1", "backbone.embed_tokens",
                     "backbone.layers.0", "backbone.layers.1", "action_head.vl_self_attention.transformer_blocks.0",
                     "action_head.action_encoder", *(f"action_head.model.transformer_blocks.{i}" for i in range(4))]
    plan = make_plan(model, ParallelismConfig(activation_checkpointing="full"), PrecisionConfig(mode="bf16"),
                     dp_replicate=1, dp_shard=2)
    assert "backbone.embed_tokens" not in plan.ac_units and "backbone.layers.1" in plan.ac_units
    assert plan.unsharded_after_forward == ("action_head.model.transformer_blocks.3", "<root>")
    # every parameter outside the units is what the root takes: small ones only
    in_units = {id(p) for _, unit in declared_units(model) for p in unit.parameters()}
    root = {n for n, p in model.named_parameters() if id(p) not in in_units}
    assert root == {"backbone.vision.patch_embed.weight", "backbone.vision.patch_embed.bias",
                    "backbone.vision.position_embedding", "backbone.vision.post_norm.weight",
                    "backbone.vision.post_norm.bias", "backbone.projector.weight", "backbone.projector.bias",
                    "backbone.norm.weight", "action_head.vlln.weight", "action_head.vlln.bias",
                    *(f"action_head.{m}.{layer}.{p}" for m in ("state_encoder", "action_decoder")
                      for layer in ("layer1", "layer2") for p in ("W", "b")),
                    "action_head.future_tokens.weight", "action_head.position_embedding.weight",
                    *(f"action_head.model.{m}.{p}" for m in ("timestep_encoder.timestep_embedder.linear_1",
                                                             "timestep_encoder.timestep_embedder.linear_2",
                                                             "proj_out_1", "proj_out_2") for p in ("weight", "bias"))}


def test_fp8_takes_the_block_linears_and_leaves_norms_heads_and_projections():
    model = build_model(CFG)
    keep = fp8_filter_for(model)
    chosen = {name for name, module in model.named_modules() if keep(module, name)}
    assert "action_head.model.transformer_blocks.0.attn1.to_k" in chosen  # cross: 128-d VLM keys -> the DiT width
    assert "action_head.model.transformer_blocks.1.ff.net.0.proj" in chosen
    assert "action_head.vl_self_attention.transformer_blocks.0.attn1.to_out.0" in chosen
    assert "backbone.layers.0.self_attn.q_proj" in chosen and "backbone.vision.blocks.1.fc2" in chosen
    for left in ("action_head.model.transformer_blocks.0.norm1.linear", "backbone.projector",
                 "action_head.model.proj_out_2", "action_head.model.timestep_encoder.timestep_embedder.linear_1"):
        assert left not in chosen
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert all(n.startswith(("backbone.vision.blocks", "backbone.layers", "action_head.vl_self_attention",
                             "action_head.model.transformer_blocks")) for n in chosen)
    assert len(chosen) == 2 * 6 + 2 * 7 + 1 * 6 + 4 * 6 < len(linears)


@pytest.mark.slow
def test_a_torchao_fp8_groot_trains_on_cpu():
    require("torchao.float8", "fp8")
    torch.manual_seed(0)
    model = build_model(CFG, PrecisionConfig(mode="fp8", fp8_backend="torchao"))
    assert count_fp8_linears(model)[0] == 56
    loss = model(make_batch(2)).loss
    loss.backward()
    assert torch.isfinite(loss) and model.action_head.model.transformer_blocks[0].attn1.to_q.weight.grad is not None
