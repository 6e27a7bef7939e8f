"""GR00T-N1.5 at full size on the meta device: parameter counts, and every key and shape of the published
nvidia/GR00T-N1.5-3B layout, written out below from the published configs (not from our code)."""

from __future__ import annotations

import pytest
import torch

from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model
from embodyhpc.models.groot.weights import published_shapes

FULL = ModelConfig(name="groot", size="full", action_horizon=16, action_dim=32, max_token_len=512,
                   tokenizer_path=None)


def published_layout() -> dict[str, tuple[int, ...]]:
    """The GR00T_N1_5 state dict: Eagle 2.5 (SigLIP 27 x 1152, mlp1, Qwen3-1.7B cut to 12 layers, lm_head) and the
    flow-matching head (config: hidden 1024, input_embedding_dim 1536, 32 embodiments, max_state_dim 64,
    action_dim 32, max_seq_len 1024, 32 future tokens, DiT 16 x (32 x 48), VL adapter 4 x (32 x 64))."""
    out: dict[str, tuple[int, ...]] = {}
    v = "backbone.eagle_model.vision_model.vision_model."
    out[v + "embeddings.patch_embedding.weight"] = (1152, 3, 14, 14)
    out[v + "embeddings.patch_embedding.bias"] = (1152,)
    out[v + "embeddings.position_embedding.weight"] = (256, 1152)
    for i in range(27):
        p = f"{v}encoder.layers.{i}."
        for norm in ("layer_norm1", "layer_norm2"):
            out[p + norm + ".weight"] = out[p + norm + ".bias"] = (1152,)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            out[p + f"self_attn.{proj}.weight"], out[p + f"self_attn.{proj}.bias"] = (1152, 1152), (1152,)
        out[p + "mlp.fc1.weight"], out[p + "mlp.fc1.bias"] = (4304, 1152), (4304,)
        out[p + "mlp.fc2.weight"], out[p + "mlp.fc2.bias"] = (1152, 4304), (1152,)
    out[v + "post_layernorm.weight"] = out[v + "post_layernorm.bias"] = (1152,)
    out[v + "head.probe"] = (1, 1, 1152)
    out[v + "head.attention.in_proj_weight"], out[v + "head.attention.in_proj_bias"] = (3456, 1152), (3456,)
    out[v + "head.attention.out_proj.weight"], out[v + "head.attention.out_proj.bias"] = (1152, 1152), (1152,)
    out[v + "head.layernorm.weight"] = out[v + "head.layernorm.bias"] = (1152,)
    out[v + "head.mlp.fc1.weight"], out[v + "head.mlp.fc1.bias"] = (4304, 1152), (4304,)
    out[v + "head.mlp.fc2.weight"], out[v + "head.mlp.fc2.bias"] = (1152, 4304), (1152,)
    out["backbone.eagle_model.mlp1.0.weight"], out["backbone.eagle_model.mlp1.0.bias"] = (2048, 1152), (2048,)
    lm = "backbone.eagle_model.language_model."
    out[lm + "model.embed_tokens.weight"] = out[lm + "lm_head.weight"] = (151680, 2048)
    for i in range(12):
        p = f"{lm}model.layers.{i}."
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = (2048,)
        out[p + "self_attn.q_proj.weight"], out[p + "self_attn.o_proj.weight"] = (2048, 2048), (2048, 2048)
        out[p + "self_attn.k_proj.weight"] = out[p + "self_attn.v_proj.weight"] = (1024, 2048)
        out[p + "self_attn.q_norm.weight"] = out[p + "self_attn.k_norm.weight"] = (128,)
        out[p + "mlp.gate_proj.weight"] = out[p + "mlp.up_proj.weight"] = (6144, 2048)
        out[p + "mlp.down_proj.weight"] = (2048, 6144)
    out[lm + "model.norm.weight"] = (2048,)
    h = "action_head."
    out[h + "vlln.weight"] = out[h + "vlln.bias"] = (2048,)
    for i in range(4):
        p = f"{h}vl_self_attention.transformer_blocks.{i}."
        for norm in ("norm1", "norm3"):
            out[p + norm + ".weight"] = out[p + norm + ".bias"] = (2048,)
        for proj in ("to_q", "to_k", "to_v", "to_out.0"):
            out[p + f"attn1.{proj}.weight"], out[p + f"attn1.{proj}.bias"] = (2048, 2048), (2048,)
        out[p + "ff.net.0.proj.weight"], out[p + "ff.net.0.proj.bias"] = (8192, 2048), (8192,)
        out[p + "ff.net.2.weight"], out[p + "ff.net.2.bias"] = (2048, 8192), (2048,)

    def category(name: str, d_in: int, d_out: int) -> None:
        out[f"{h}{name}.W"], out[f"{h}{name}.b"] = (32, d_in, d_out), (32, d_out)

    category("state_encoder.layer1", 64, 1024)
    category("state_encoder.layer2", 1024, 1536)
    category("action_encoder.W1", 32, 1536)
    category("action_encoder.W2", 3072, 1536)
    category("action_encoder.W3", 1536, 1536)
    category("action_decoder.layer1", 1024, 1024)
    category("action_decoder.layer2", 1024, 32)
    out[h + "future_tokens.weight"] = (32, 1536)
    out[h + "position_embedding.weight"] = (1024, 1536)
    d = h + "model."
    out[d + "timestep_encoder.timestep_embedder.linear_1.weight"] = (1536, 256)
    out[d + "timestep_encoder.timestep_embedder.linear_1.bias"] = (1536,)
    out[d + "timestep_encoder.timestep_embedder.linear_2.weight"] = (1536, 1536)
    out[d + "timestep_encoder.timestep_embedder.linear_2.bias"] = (1536,)
    for i in range(16):
        p = f"{d}transformer_blocks.{i}."
        out[p + "norm1.linear.weight"], out[p + "norm1.linear.bias"] = (3072, 1536), (3072,)
        kv_in = 2048 if i % 2 == 0 else 1536  # even blocks cross-attend to the 2048-d VLM features
        out[p + "attn1.to_q.weight"], out[p + "attn1.to_q.bias"] = (1536, 1536), (1536,)
        out[p + "attn1.to_k.weight"], out[p + "attn1.to_k.bias"] = (1536, kv_in), (1536,)
        out[p + "attn1.to_v.weight"], out[p + "attn1.to_v.bias"] = (1536, kv_in), (1536,)
        out[p + "attn1.to_out.0.weight"], out[p + "attn1.to_out.0.bias"] = (1536, 1536), (1536,)
        out[p + "ff.net.0.proj.weight"], out[p + "ff.net.0.proj.bias"] = (6144, 1536), (6144,)
        out[p + "ff.net.2.weight"], out[p + "ff.net.2.bias"] = (1536, 6144), (1536,)
    out[d + "proj_out_1.weight"], out[d + "proj_out_1.bias"] = (3072, 1536), (3072,)
    out[d + "proj_out_2.weight"], out[d + "proj_out_2.bias"] = (1024, 1536), (1024,)
    return out


@pytest.fixture(scope="module")
def full_model():
    with torch.device("meta"):
        return build_model(FULL)


def _count(shapes) -> int:
    return sum(torch.Size(s).numel() for s in shapes)


def test_every_published_key_and_shape(full_model):
    ours, theirs = published_shapes(full_model), published_layout()
    assert sorted(set(theirs) - set(ours)) == [] and sorted(set(ours) - set(theirs)) == []
    wrong = {k: (ours[k], theirs[k]) for k in theirs if tuple(ours[k]) != theirs[k]}
    assert wrong == {}


def test_parameter_counts_used_and_stored(full_model):
    params = dict(full_model.named_parameters())
    used = sum(p.numel() for p in params.values())
    stored = _count(published_shapes(full_model).values())
    print(f"\nGR00T-N1.5 full: {used / 1e9:.3f}B used in forward, {stored / 1e9:.3f}B stored")
    assert abs(used - 2.398e9) < 0.005e9 and abs(stored - 2.724e9) < 0.005e9

    def part(prefix: str) -> float:
        return sum(p.numel() for n, p in params.items() if n.startswith(prefix)) / 1e6

    assert part("action_head.model.") == pytest.approx(550.4, abs=0.1)
    assert part("action_head.vl_self_attention.") == pytest.approx(201.4, abs=0.1)
    assert part("action_head.action_encoder.") == pytest.approx(228.2, abs=0.1)
    assert part("action_head.state_encoder.") == pytest.approx(52.5, abs=0.1)
    assert part("action_head.action_decoder.") == pytest.approx(34.6, abs=0.1)
    assert part("action_head.") == pytest.approx(1068.8, abs=0.2)
    assert part("backbone.vision.") == pytest.approx(412.4, abs=0.1)
    # the frozen VLM: ~1.33B of the 2.4B
    frozen = sum(p.numel() for p in params.values() if not p.requires_grad)
    assert frozen == sum(p.numel() for n, p in params.items() if n.startswith("backbone."))
