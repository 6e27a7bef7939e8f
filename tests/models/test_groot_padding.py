"""GR00T pads every token stream that reaches a block's Linear to a multiple of 16 rows x tokens (fp8 GEMMs need it,
models/groot/plan.py), and the padding changes nothing: the velocity and the parameter gradients of the padded,
packed model equal a per-sample computation written here without any padding, plan or attention seam (each
sample's own tokens through the same weights, plain SDPA: causal in the LLM, bidirectional in the VL adapter and the
DiT, cross-attention over the sample's own VLM tokens)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model
from embodyhpc.models.groot.batch import GrootSample, collate
from embodyhpc.models.groot.plan import aligned_width, build_plan
from embodyhpc.models.rope import apply_rope, rope_angles

HORIZON, ACTION_DIM = 16, 4
CFG = ModelConfig(name="groot", size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM, max_token_len=96,
                  options={"tune_llm": True, "tune_visual": True})


# ---- the reference: one sample at a time, its own tokens only ----
def sdpa(q, k, v, *, causal=False):
    """q [1, Tq, H, D], k/v [1, Tk, Hkv, D] -> [1, Tq, H, D]."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def llm_layer(layer, x, angles):
    a = layer.self_attn
    h = layer.input_layernorm(x)
    q = apply_rope(a.q_norm(a.q_proj(h).unflatten(-1, (a.heads, a.head_dim))), angles)
    k = apply_rope(a.k_norm(a.k_proj(h).unflatten(-1, (a.kv_heads, a.head_dim))), angles)
    v = a.v_proj(h).unflatten(-1, (a.kv_heads, a.head_dim))
    x = x + a.o_proj(sdpa(q, k, v, causal=True).flatten(2))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def attention_block(block, x, keys_from, h):
    a = block.attn1
    out = sdpa(a.split(a.to_q(h)), a.split(a.to_k(keys_from)), a.split(a.to_v(keys_from)))
    x = x + a.out(out)
    return x + block.ff(block.norm3(x))


def reference_velocity(model, batch, i: int, noisy: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
    """Sample i's velocity [H, A], computed on its tokens alone."""
    backbone, head, shape = model.backbone, model.action_head, model.shape
    num_text = int(batch.text_lengths[i])
    patches = backbone.projector(backbone.vision(batch.images[i]))  # [C, P, width]
    x = torch.cat([patches.flatten(0, 1), backbone.embed_tokens(batch.text_ids[i, :num_text])])[None]
    angles = rope_angles(torch.arange(x.shape[1])[None], shape.llm.head_dim, shape.llm.rope_base)
    for layer in backbone.layers:
        x = llm_layer(layer, x, angles)
    context = head.vlln(backbone.norm(x))
    for block in head.vl_self_attention.transformer_blocks:
        context = attention_block(block, context, block.norm1(context), block.norm1(context))
    category = batch.embodiment[i:i + 1]
    state = F.pad(batch.state[i:i + 1].float(), (0, shape.head.max_state_dim - batch.state.shape[-1]))
    actions = head.action_encoder(noisy[None], timestep[None], category)
    actions = actions + head.position_embedding.weight[:HORIZON][None]
    x = torch.cat([head.state_encoder(state[:, None], category), head.future_tokens.weight[None], actions], dim=1)
    dit = head.model
    temb = dit.timestep_encoder(timestep[None])
    for block in dit.transformer_blocks:
        h = block.norm1(x, temb)
        x = attention_block(block, x, context if block.cross else h, h)
    shift, scale = dit.proj_out_1(F.silu(temb)).chunk(2, dim=-1)
    x = F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1.0 + scale[:, None]) + shift[:, None]
    return head.action_decoder(dit.proj_out_2(x), category)[0, -HORIZON:]


def model_velocity(model, batch, noisy, timestep) -> torch.Tensor:
    plan = model.plan(batch)
    context, ctx = model.encode(batch, plan)
    return model.action_head.velocity(context, model.padded_state(batch), noisy, timestep, batch.embodiment, ctx)


# ---- batches ----
def make_batch(text_lengths: list[int], cameras: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = [GrootSample(images=torch.rand(cameras, 3, 32, 32, generator=g), text_ids=list(range(3, 3 + n)),
                           state=torch.randn(39, generator=g), actions=torch.randn(HORIZON, ACTION_DIM, generator=g))
               for n in text_lengths]
    return collate(samples, embodiment_id=31)


CASES = {  # text lengths, rows; 2 cameras x 16 patches = 32 image tokens per sample
    "packed": ([3, 30, 1, 12, 5], [[0, 2, 4], [1, 3]]),
    "one row per sample": ([3, 30, 1, 12, 5], None),
    "an empty row": ([7, 9], [[0], [], [1]]),
    "a single sample": ([5], None),
    "an empty instruction": ([0, 4], [[0, 1]]),
    "already aligned": ([0, 16, 0, 16], [[0], [1], [2], [3]]),  # 32 and 48 tokens: T = 48 without padding
    "sixteen samples": ([1 + i % 5 for i in range(16)], None),  # N x S = 16 x 21 is aligned: S' = S
}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(CFG)


@pytest.mark.parametrize("case", CASES)
def test_padded_rows_compute_each_sample_as_if_alone(model, case: str) -> None:
    text_lengths, rows = CASES[case]
    batch = make_batch(text_lengths).with_rows(rows)
    num = batch.num_samples
    g = torch.Generator().manual_seed(1)
    noisy, timestep = torch.randn(num, HORIZON, ACTION_DIM, generator=g), torch.randint(0, 1000, (num,)).float()
    plan = model.plan(batch)
    (num_rows, width), stride = plan.vl_segments.shape, plan.token_stride
    assert (num_rows * width) % 16 == 0 and (num_rows * plan.key_width) % 16 == 0 and (num * stride) % 16 == 0
    with torch.no_grad():
        got = model_velocity(model, batch, noisy, timestep)
        want = torch.stack([reference_velocity(model, batch, i, noisy[i], timestep[i]) for i in range(num)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_padding_leaks_into_no_gradient(model) -> None:
    """The smoke batch's shape (4 samples: S = 21 -> S' = 24; rows padded to a multiple of 16 tokens): the gradient of
    every parameter equals the unpadded per-sample computation's."""
    batch = make_batch([3, 30, 1, 12]).with_rows([[0, 2], [1], [3]])
    plan = model.plan(batch)
    assert plan.token_stride == 24 > plan.tokens_per_sample == 21
    assert plan.vl_segments.shape[1] > max(32 + n for n in (3, 30, 1, 12))  # 62 tokens at most -> 64
    g = torch.Generator().manual_seed(2)
    noisy, timestep = torch.randn(4, HORIZON, ACTION_DIM, generator=g), torch.tensor([0.0, 250.0, 500.0, 999.0])
    weights = torch.randn(4, HORIZON, ACTION_DIM, generator=g)
    grads = []
    for compute in ("model", "reference"):
        model.zero_grad()
        if compute == "model":
            velocity = model_velocity(model, batch, noisy, timestep)
        else:
            velocity = torch.stack([reference_velocity(model, batch, i, noisy[i], timestep[i]) for i in range(4)])
        (velocity * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any(n.startswith("backbone.layers.") for n in grads[0])
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize(("length", "rows", "width"), [
    (0, 1, 16), (1, 1, 16), (16, 1, 16), (17, 1, 32), (121, 3, 128), (21, 4, 24), (21, 16, 21), (21, 5, 32),
    (7, 2, 8), (9, 8, 10)])
def test_aligned_width_is_the_smallest_aligned_width(length: int, rows: int, width: int) -> None:
    assert aligned_width(length, rows) == width
    assert (rows * width) % 16 == 0 and width >= max(length, 1)
    assert all((rows * w) % 16 for w in range(max(length, 1), width))  # nothing smaller is aligned


def test_the_plan_refuses_rows_that_misplace_samples() -> None:
    for rows in ([[0]], [[0, 1], [1]], []):
        with pytest.raises(ValueError, match="exactly once"):
            build_plan(rows=rows, num_image_tokens=32, text_lengths=[3, 4] if rows != [[0]] else [3, 4],
                       max_text_len=4, tokens_per_sample=21)
    assert math.prod(build_plan(rows=[[0], [1]], num_image_tokens=32, text_lengths=[0, 0], max_text_len=1,
                                tokens_per_sample=21).vl_segments.shape) == 64  # 2 x 32: already aligned


def test_the_tune_options_do_not_change_the_padding() -> None:
    """Frozen or trainable, the same plan: padding is no precision- or option-dependent branch."""
    frozen = build_model(dataclasses.replace(CFG, options={}))
    batch = make_batch([3, 30, 1, 12]).with_rows([[0, 2], [1], [3]])
    a, b = frozen.plan(batch), build_model(CFG).plan(batch)
    assert (a.token_stride, a.key_width, a.vl_source.shape) == (b.token_stride, b.key_width, b.vl_source.shape)
