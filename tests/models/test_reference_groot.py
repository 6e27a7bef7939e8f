"""GR00T-N1.5 against independent implementations, loaded through our published-weights adapter (weights.py).

- The VLM (backbone.py) against transformers 5.x's own modules at random init (no download):
  `transformers.models.siglip.modeling_siglip.SiglipVisionModel` -> a Linear projector (Eagle's mlp1.0) ->
  `transformers.models.qwen3.modeling_qwen3.Qwen3Model` cut as Isaac-GR00T's EagleBackbone cuts it (the layers past
  `select_layer` popped, features = `hidden_states[select_layer]`, which in transformers' Qwen3Model is the final
  RMSNorm applied to that layer's output: the norm is part of what the action head reads). The weights are written
  under the published GR00T-N1.5 key names (spelled out here, not taken from weights.py). Tolerance: float32,
  atol 2e-5 / rtol 1e-4 (the two differ in summation order only).
  The input layout is ours (a sample's image tokens, then its instruction; Eagle places the image tokens at its
  chat template's <IMG_CONTEXT> tokens): the reference gets the same token order, so this checks the layers.
- The action head (head.py, layers.py, model.py's time bucketing, x_t and Euler loop) against golden outputs of
  LeRobot 0.4.4's port of Isaac-GR00T's N1.5 head (`lerobot.policies.groot.action_head.flow_matching_action_head.
  FlowmatchingActionHead` with `cross_attention_dit.DiT` / `SelfAttentionTransformer` on diffusers): the fixture
  tests/models/reference/groot_head{.json,.safetensors,_io.safetensors} written by tools/reference_fixtures/
  groot_head.py (its docstring has the command and versions). Compared: the predicted velocity and the loss of a
  training forward at given noise and times (a full action mask, where the port's global mean equals our mean of
  per-sample means), and the chunk of 4 Euler steps from given noise. Tolerance: float32, atol 1e-5 / rtol 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen3Config, Qwen3Model, SiglipVisionConfig, SiglipVisionModel

from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model
from embodyhpc.models.groot.batch import GrootBatch, GrootSample, collate
from embodyhpc.models.groot.model import GrootPolicy
from embodyhpc.models.groot.plan import to_rows
from embodyhpc.models.groot.shapes import GrootShape, HeadShape, LlmShape, shape_for
from embodyhpc.models.groot.weights import load_groot_weights, to_published
from embodyhpc.models.shapes import VisionShape

REFERENCE = Path(__file__).parent / "reference"
# the published GR00T-N1.5 key prefixes (nvidia/GR00T-N1.5-3B's model.safetensors.index.json)
PUB_VISION = "backbone.eagle_model.vision_model.vision_model."
PUB_PROJECTOR = "backbone.eagle_model.mlp1.0."
PUB_LLM = "backbone.eagle_model.language_model.model."
PUB_LM_HEAD = "backbone.eagle_model.language_model.lm_head.weight"
CAMERAS, TEXT_LENGTHS = 2, [5, 9, 3]


# ---------------------------------------------------------------- the VLM against transformers
@pytest.fixture(scope="module")
def vlm():
    """(our tiny GR00T with the reference's weights, the reference's three modules, select_layer)."""
    shape = shape_for("tiny")
    vs, ls = shape.vision, shape.llm
    select_layer = ls.depth  # the tiny LLM keeps `depth` layers as N1.5 keeps 12 of Qwen3-1.7B's 28
    torch.manual_seed(0)
    vision = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=vs.width, intermediate_size=vs.mlp_dim, num_hidden_layers=vs.depth,
        num_attention_heads=vs.num_heads, image_size=vs.image_size, patch_size=vs.patch_size,
        attn_implementation="eager")).eval()
    projector = nn.Linear(vs.width, ls.width)
    llm = Qwen3Model(Qwen3Config(
        vocab_size=ls.vocab_size, hidden_size=ls.width, intermediate_size=ls.mlp_dim,
        num_hidden_layers=select_layer + 2, num_attention_heads=ls.num_heads, num_key_value_heads=ls.num_kv_heads,
        head_dim=ls.head_dim, rope_theta=ls.rope_base, rms_norm_eps=ls.norm_eps, attn_implementation="eager")).eval()
    while len(llm.layers) > select_layer:  # Isaac-GR00T's EagleBackbone: pop the layers past select_layer
        llm.layers.pop(-1)
    with torch.no_grad():  # norms and biases away from their init values, so that a misplaced one shows
        for name, p in [*vision.named_parameters(), *llm.named_parameters()]:
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model = build_model(ModelConfig(name="groot", size="tiny", action_horizon=16, action_dim=4, max_token_len=96))
    published = {PUB_VISION + k: v for k, v in vision.state_dict().items()}
    published |= {PUB_PROJECTOR + k: v for k, v in projector.state_dict().items()}
    published |= {PUB_LLM + k: v for k, v in llm.state_dict().items()}
    published[PUB_LM_HEAD] = llm.embed_tokens.weight.detach().clone()  # tied in Qwen3-1.7B
    ours = to_published(model.state_dict(), model.shape, placeholders=False)
    published |= {k: v for k, v in ours.items() if k.startswith("action_head.")}  # not compared here
    report = load_groot_weights(model, published)
    assert not report.missing and not report.unexpected
    return model.eval(), vision, projector, llm, select_layer


def _reference_features(vision, projector, llm, select_layer, images, text_ids):
    """GR00T-N1.5's backbone features of one sample: SigLIP (pixels normalised with mean = std = 0.5) -> mlp1 ->
    Qwen3 on [image tokens, text tokens], hidden_states[select_layer]."""
    patches = projector(vision(pixel_values=(images - 0.5) / 0.5).last_hidden_state).flatten(0, 1)
    embeds = torch.cat([patches, llm.embed_tokens(text_ids)])[None]
    out = llm(inputs_embeds=embeds, output_hidden_states=True)
    return out.hidden_states[select_layer][0]


@torch.no_grad()
def test_the_vlm_features_match_transformers_siglip_and_qwen3_cut_at_select_layer(vlm):
    model, vision, projector, llm, select_layer = vlm
    g = torch.Generator().manual_seed(1)
    samples = [GrootSample(images=torch.rand(CAMERAS, 3, 32, 32, generator=g),
                           text_ids=torch.randint(1, 300, (n,), generator=g).tolist(), state=torch.zeros(64))
               for n in TEXT_LENGTHS]
    rows = [[0, 1], [2]]  # packed: two samples share a row
    batch = collate(samples, embodiment_id=31).with_rows(rows)
    plan = model.plan(batch)
    llm_attention = plan.llm_layout.prepare(model.attention_backend, dtype=torch.float32, needs_grad=False)
    features = model.backbone(batch.images, batch.text_ids, plan, llm_attention)
    image_tokens = CAMERAS * model.shape.vision.num_patches
    for r, row in enumerate(rows):
        start = 0
        for s in row:
            n = image_tokens + TEXT_LENGTHS[s]
            expected = _reference_features(vision, projector, llm, select_layer, batch.images[s],
                                           batch.text_ids[s, :TEXT_LENGTHS[s]])
            torch.testing.assert_close(features[r, start:start + n], expected, atol=2e-5, rtol=1e-4,
                                       msg=lambda m, s=s: f"sample {s}: {m}")
            start += n


# ---------------------------------------------------------------- the action head against LeRobot 0.4.4's port
@pytest.fixture(scope="module")
def head_fixture():
    meta = json.loads((REFERENCE / "groot_head.json").read_text())
    return meta, load_file(REFERENCE / "groot_head.safetensors"), load_file(REFERENCE / "groot_head_io.safetensors")


@pytest.fixture(scope="module")
def head_model(head_fixture):
    """A GrootPolicy of the fixture's size holding the reference head's weights (loaded by their published names);
    its VLM is not part of the comparison: it is given the fixture's VLM features instead."""
    meta, weights, _ = head_fixture
    s = meta["size"]
    vision = VisionShape(image_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=32)
    llm = LlmShape(width=s["vlm_width"], depth=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32, vocab_size=64)
    head = HeadShape(vl_heads=s["vl_heads"], vl_depth=s["vl_depth"], dit_width=s["dit_width"], dit_heads=s["dit_heads"],
                     dit_depth=s["dit_depth"], hidden=s["hidden"], max_state_dim=s["max_state_dim"],
                     num_future_tokens=s["num_future_tokens"], num_embodiments=s["num_embodiments"],
                     max_seq_len=s["max_seq_len"])
    torch.manual_seed(0)
    model = GrootPolicy(GrootShape(vision, llm, head), action_horizon=s["action_horizon"], action_dim=s["action_dim"])
    ours = to_published(model.state_dict(), model.shape, placeholders=False)
    published = {k: v for k, v in ours.items() if k.startswith("backbone.")} | weights
    report = load_groot_weights(model, published)  # strict: every action_head tensor of ours is in the fixture
    assert not report.missing and not report.unexpected
    return model.eval()


def _head_batch(meta, io, rows):
    """A batch whose VLM tokens are the fixture's: 1 camera (its patches) + text, VL_TOKENS per sample."""
    n, tokens = meta["batch"], meta["vl_tokens"]
    patches = 4  # 16 px images, patch 8
    return GrootBatch(images=torch.zeros(n, 1, 3, 16, 16), text_ids=torch.ones(n, tokens - patches, dtype=torch.long),
                      text_lengths=torch.full((n,), tokens - patches), state=io["state"], embodiment=io["embodiment"],
                      actions=io["actions"], rows=rows)


def _given_vlm_features(model, monkeypatch, vl):
    """The backbone returns the fixture's features [N, T, W] in the plan's rows (image tokens, then text)."""
    patches = model.shape.vision.num_patches

    def features(images, text_ids, plan, llm):
        source = torch.cat([vl[:, :patches].flatten(0, 1), vl[:, patches:].flatten(0, 1)])
        return to_rows(source, plan.vl_source)

    monkeypatch.setattr(model.backbone, "forward", features)


@pytest.mark.parametrize("rows", [None, [[0, 1]]], ids=["a-row-each", "packed"])
@torch.no_grad()
def test_the_action_head_matches_lerobots_groot_port(head_fixture, head_model, monkeypatch, rows):
    """FlowmatchingActionHead.forward (velocity, loss) and .get_action (4 Euler steps) of LeRobot 0.4.4."""
    meta, _, io = head_fixture
    model = head_model
    _given_vlm_features(model, monkeypatch, io["vl_features"])
    batch = _head_batch(meta, io, rows)
    velocities = []
    velocity = model.action_head.velocity
    monkeypatch.setattr(model.action_head, "velocity", lambda *a: velocities.append(velocity(*a)) or velocities[-1])
    out = model(batch, noise=io["train_noise"], time=io["time"])
    torch.testing.assert_close(velocities[0], io["velocity"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out.loss, io["loss"], atol=1e-5, rtol=1e-4)
    sampled = model.sample_actions(batch, noise=io["sample_noise"], num_steps=meta["size"]["num_inference_steps"])
    torch.testing.assert_close(sampled, io["sampled_actions"], atol=1e-5, rtol=1e-4)
