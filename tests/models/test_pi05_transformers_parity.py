"""pi0.5's PaliGemma backbone against transformers' own modules (the dev extra's transformers 5.x; random init at a
tiny size, nothing downloaded). A transformers PaliGemmaForConditionalGeneration's state dict, under the published
pi0.5 key names (`paligemma_with_expert.paligemma.` + its own names, in transformers 4.x's layout), is loaded through
our published-weights adapter (models/pi05/weights.py, strict), and our modules must reproduce:
- transformers.models.siglip.modeling_siglip.SiglipVisionModel: the patch tokens (pixels in [-1, 1], learned
  positions, pre-LayerNorm blocks, tanh GELU, post LayerNorm);
- transformers.models.paligemma.modeling_paligemma.PaliGemmaModel.get_image_features: the projected image tokens;
- transformers.models.gemma.modeling_gemma.GemmaModel over the prefix (image tokens, then the token embeddings,
  which transformers scales by sqrt(width)), bidirectional as pi0.5's prefix: the rotary keys and the values of every
  layer ((1 + w) RMSNorm, multi-query attention, GeGLU with tanh GELU, rotate-half RoPE).
Tolerance: 1e-5 absolute + relative (float32, eager attention on both sides).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import PaliGemmaConfig, PaliGemmaForConditionalGeneration

from embodyhpc.models.pi05 import Pi05Batch, Pi05Policy
from embodyhpc.models.pi05.shapes import Pi05Shape, StreamShape
from embodyhpc.models.pi05.weights import PALIGEMMA, load_pi05_weights, to_published
from embodyhpc.models.shapes import VisionShape

SHAPE = Pi05Shape(vision=VisionShape(image_size=16, patch_size=8, width=16, depth=2, num_heads=2, mlp_dim=24),
                  vlm=StreamShape(width=32, mlp_dim=48), expert=StreamShape(width=16, mlp_dim=24),
                  depth=3, num_heads=4, num_kv_heads=1, head_dim=8, vocab_size=48)
CAMERAS, PROMPT_LEN = 2, 5
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def pair():
    """(transformers' PaliGemma, our Pi05Policy holding its weights)."""
    v, s = SHAPE.vision, SHAPE
    config = PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=v.width, intermediate_size=v.mlp_dim,
                           num_hidden_layers=v.depth, num_attention_heads=v.num_heads, image_size=v.image_size,
                           patch_size=v.patch_size, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                           vision_use_head=False),  # PaliGemma has no pooling head
        text_config=dict(model_type="gemma", hidden_size=s.vlm.width, intermediate_size=s.vlm.mlp_dim,
                         num_hidden_layers=s.depth, num_attention_heads=s.num_heads,
                         num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, vocab_size=s.vocab_size,
                         hidden_activation="gelu_pytorch_tanh", rms_norm_eps=s.norm_eps, rope_theta=s.rope_base),
        projection_dim=s.vlm.width, image_token_index=s.vocab_size - 1)
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = config.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = PaliGemmaForConditionalGeneration(config).eval()
    with torch.no_grad():  # nothing left at its zero/identity init: (1 + w) and LayerNorm affine must matter
        for name, p in theirs.named_parameters():
            if p.ndim >= 2 and "position_embedding" not in name:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
            else:
                p.normal_(1.0 if "layer_norm" in name and name.endswith("weight") else 0.0, 0.3)
    ours = Pi05Policy(SHAPE, action_horizon=4, action_dim=6)
    published = to_published(ours.state_dict(), SHAPE)  # the expert and policy heads: ours, random
    published |= {PALIGEMMA + _published_name(k): v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    load_pi05_weights(ours, published)
    return theirs, ours.eval()


def _published_name(key: str) -> str:
    """transformers 5 flattened SiglipVisionModel (its conversion_mapping drops `vision_model.` when loading older
    files); the published pi0.5 files were written by transformers 4.x and keep `vision_tower.vision_model.`."""
    tower = "model.vision_tower."
    return tower + "vision_model." + key[len(tower):] if key.startswith(tower) else key


@pytest.fixture(scope="module")
def inputs():
    g = torch.Generator().manual_seed(1)
    images = torch.rand(1, CAMERAS, 3, SHAPE.vision.image_size, SHAPE.vision.image_size, generator=g)
    prompt = torch.randint(0, SHAPE.vocab_size - 1, (1, PROMPT_LEN), generator=g)
    return Pi05Batch(images=images, prompt_ids=prompt, prompt_lengths=torch.tensor([PROMPT_LEN]))


@torch.no_grad()
def test_vision_tower_and_projector_match_transformers_siglip(pair, inputs) -> None:
    theirs, ours = pair
    pixels = inputs.images[0] * 2.0 - 1.0  # transformers' SigLIP takes [-1, 1], ours [0, 1]
    expected = theirs.model.vision_tower(pixel_values=pixels).last_hidden_state
    torch.testing.assert_close(ours.vision(inputs.images[0]), expected, **TOLERANCE)
    projected = theirs.model.get_image_features(pixel_values=pixels).pooler_output
    torch.testing.assert_close(ours.vision_projector(ours.vision(inputs.images[0])), projected, **TOLERANCE)


@torch.no_grad()
def test_prefix_keys_values_match_transformers_gemma(pair, inputs) -> None:
    theirs, ours = pair
    image_tokens = theirs.model.get_image_features(pixel_values=inputs.images[0] * 2.0 - 1.0).pooler_output
    embeds = torch.cat([image_tokens.flatten(0, 1)[None], theirs.model.language_model.embed_tokens(inputs.prompt_ids)],
                       dim=1)
    length = embeds.shape[1]
    bidirectional = torch.zeros(1, 1, length, length)  # additive mask: pi0.5's prefix attends both ways
    out = theirs.model.language_model(inputs_embeds=embeds, attention_mask=bidirectional, use_cache=True)
    cache = ours.prefix_cache(inputs, ours.token_plan(inputs))
    assert len(cache) == len(out.cache.layers) == SHAPE.depth
    for layer, (k, v) in zip(out.cache.layers, cache, strict=True):  # theirs [1, Hkv, T, D], ours [1, T', Hkv, D]
        torch.testing.assert_close(k[:, :length].transpose(1, 2), layer.keys, **TOLERANCE)
        torch.testing.assert_close(v[:, :length].transpose(1, 2), layer.values, **TOLERANCE)
