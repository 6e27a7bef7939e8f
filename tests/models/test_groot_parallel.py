"""What parallel/ and fp8 read from GR00T: its declared FSDP units and the Linear layers that go to float8."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from embodyhpc.config.schema import ModelConfig, ParallelismConfig, PrecisionConfig
from embodyhpc.models import build_model
from embodyhpc.models.fp8 import count_fp8_linears, fp8_filter_for, is_fp8_layer
from embodyhpc.parallel import declared_units, make_plan
from tests.helpers import require
from tests.models.test_groot import make_batch

CFG = ModelConfig(name="groot", size="tiny", action_horizon=16, action_dim=4, max_token_len=96)
TRAINABLE = {"tune_llm": True, "tune_visual": True}


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


def fp8_chosen(options: dict) -> set[str]:
    model = build_model(dataclasses.replace(CFG, options=options))
    keep = fp8_filter_for(model)
    return {name for name, module in model.named_modules() if keep(module, name)}


def test_fp8_takes_the_block_linears_and_leaves_norms_heads_and_projections():
    model = build_model(dataclasses.replace(CFG, options=TRAINABLE))
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


FROZEN_PARTS = ("backbone.layers.", "backbone.vision.")  # the LLM, and the vision tower (with the projector)


@pytest.mark.parametrize(("options", "frozen"), [
    ({}, FROZEN_PARTS), ({"tune_llm": True}, ("backbone.vision.",)), ({"tune_visual": True}, ("backbone.layers.",)),
    (TRAINABLE, ())])
def test_fp8_leaves_the_frozen_llm_and_vision_tower_in_high_precision(options, frozen):
    """GR00T fine-tunes with its VLM frozen: no backward runs through those weights, and float8 would shift the
    features it was pretrained on. A frozen part has no fp8 layer; a trained one has all its block layers."""
    every = fp8_chosen(TRAINABLE)
    chosen = fp8_chosen(options)
    assert chosen == {name for name in every if not name.startswith(frozen)}
    for part, count in (("backbone.layers.", 2 * 7), ("backbone.vision.", 2 * 6)):
        assert sum(name.startswith(part) for name in chosen) == (0 if part in frozen else count)
    assert sum(name.startswith("action_head.") for name in chosen) == 6 + 4 * 6  # the head always trains


@pytest.mark.slow
def test_a_torchao_fp8_groot_trains_on_cpu():
    require("torchao.float8", "fp8")
    torch.manual_seed(0)
    model = build_model(CFG, PrecisionConfig(mode="fp8", fp8_backend="torchao"))
    assert count_fp8_linears(model)[0] == 56 - 2 * 7 - 2 * 6  # the frozen LLM and vision tower stay as they are
    assert not any(is_fp8_layer(m) for m in model.backbone.modules())
    trainable = build_model(dataclasses.replace(CFG, options=TRAINABLE), PrecisionConfig(mode="fp8",
                                                                                         fp8_backend="torchao"))
    assert count_fp8_linears(trainable)[0] == 56
    assert is_fp8_layer(trainable.backbone.layers[0].self_attn.q_proj)
    loss = model(make_batch(2)).loss
    loss.backward()
    assert torch.isfinite(loss) and model.action_head.model.transformer_blocks[0].attn1.to_q.weight.grad is not None


def test_a_te_fp8_groot_passes_te_alignment_asserts_on_its_smoke_batch(te_double):
    """transformer-engine (the CPU double, with TE's own assert_dim_for_fp8_exec) refuses a float8 GEMM whose input's
    leading dims multiply to no multiple of 8 or whose last dim is no multiple of 16: before GR00T padded its token
    streams, the smoke batch's first LLM layer failed it on dims [3, 121, 128]."""
    from embodyhpc.models.fp8 import fp8_autocast
    from embodyhpc.models.groot.smoke import SMOKE

    te = PrecisionConfig(mode="fp8", fp8_backend="te", fp8_recipe="current")
    model_cfg = SMOKE.config("tiny", "sdpa_reference")
    torch.manual_seed(0)
    model = build_model(model_cfg, te)
    assert count_fp8_linears(model)[0] == 56
    batch, noise, flow_time, _ = SMOKE.fixed_batch(model_cfg, 0)
    with fp8_autocast(te):
        loss = model(batch, noise=noise, time=flow_time).loss
    loss.backward()
    assert torch.isfinite(loss) and model.backbone.layers[0].self_attn.q_proj.weight.grad is not None
