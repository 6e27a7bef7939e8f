"""Causal attention over packed samples (a decoder LLM such as GR00T's Qwen3): every backend against each sample
computed alone with SDPA's own causal mask, forward and backward; the GPU kernels through their doubles
(flash-attn 2.8.3's `causal`, torch 2.13 varlen_attn's window_size=(-1, 0)); misuse refused."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from embodyhpc.models.attention import PAD_SEGMENT, AttentionLayout, PreparedAttention, attend
from tests.models.test_attention_seams import flash_double, varlen_attn_2_13  # noqa: F401  (a fixture)

LENGTHS = [[5, 1, 7], [9], [3, 2, 4, 6]]  # samples per row; rows padded to the longest (+2)
HEADS, KV_HEADS, DIM = 4, 2, 8


def causal_layout(interleave: bool, seed: int = 0) -> tuple[AttentionLayout, list[list[list[int]]]]:
    """Rows of packed samples; with `interleave`, a row's samples are interleaved (each keeps its own order) and the
    padding scattered. Returns the layout and, per row, each sample's token indices in order."""
    rng = random.Random(seed)
    width = max(sum(row) for row in LENGTHS) + 2
    segment = torch.full((len(LENGTHS), width), PAD_SEGMENT)
    where = []
    for r, row in enumerate(LENGTHS):
        slots = [slot for slot, n in enumerate(row) for _ in range(n)] + [PAD_SEGMENT] * (width - sum(row))
        if interleave:
            rng.shuffle(slots)
        segment[r] = torch.tensor(slots)
        where.append([[t for t, s in enumerate(slots) if s == slot] for slot in range(len(row))])
    return AttentionLayout.causal_segments(segment), where


def qkv(layout: AttentionLayout, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows, tokens, _ = layout.shape
    return [torch.randn(rows, tokens, heads, DIM, generator=g).to(dtype) for heads in (HEADS, KV_HEADS, KV_HEADS)]


def alone(q, k, v, where) -> torch.Tensor:
    """Each sample by itself, SDPA's causal mask, float64; zeros elsewhere (padding is not compared)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r, samples in enumerate(where):
        for tokens in samples:
            qs, ks, vs = (t[r, tokens].double().transpose(0, 1) for t in (q, k, v))
            ks, vs = (t.repeat_interleave(HEADS // KV_HEADS, dim=0) for t in (ks, vs))
            out[r, tokens] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    return out


def real_tokens(where) -> list[tuple[int, int]]:
    return [(r, t) for r, samples in enumerate(where) for tokens in samples for t in tokens]


def run(prepared: PreparedAttention, inputs, upstream):
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    out = attend(q, k, v, prepared=prepared)
    out.backward(upstream)
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("interleave", [False, True], ids=["contiguous", "interleaved"])
def test_reference_and_segments_equal_each_sample_alone_forward_and_backward(interleave) -> None:
    layout, where = causal_layout(interleave)
    inputs = qkv(layout)
    upstream = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    expected = alone(*inputs, where)
    results = {name: run(layout.prepare(name, needs_grad=True), inputs, upstream)
               for name in ("sdpa_reference", "sdpa_segments")}
    rows, cols = zip(*real_tokens(where), strict=True)
    for name, (out, _) in results.items():
        torch.testing.assert_close(out[rows, cols].double(), expected[rows, cols], atol=1e-5, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    for grad, ref in zip(results["sdpa_segments"][1], results["sdpa_reference"][1], strict=True):
        torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5)
    # the first token of every sample sees itself only: its output is its own value
    for r, samples in enumerate(where):
        for tokens in samples:
            first = results["sdpa_segments"][0][r, tokens[0]]
            torch.testing.assert_close(first, inputs[2][r, tokens[0]].repeat_interleave(HEADS // KV_HEADS, dim=0))


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_flex_equals_each_sample_alone() -> None:
    layout, where = causal_layout(interleave=True)
    q, k, v = qkv(layout)
    with torch.no_grad():
        out = attend(q, k, v, layout=layout, backend="flex")
    rows, cols = zip(*real_tokens(where), strict=True)
    torch.testing.assert_close(out[rows, cols].double(), alone(q, k, v, where)[rows, cols], atol=1e-5, rtol=1e-5)


def test_flash_varlen_gets_its_causal_flag(flash_double) -> None:  # noqa: F811
    layout, where = causal_layout(interleave=True)
    inputs = qkv(layout, dtype=torch.bfloat16)
    upstream = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    plan = layout.prepare("sdpa_segments", needs_grad=True).varlen
    out, grads = run(PreparedAttention("flash_varlen", varlen=plan), inputs, upstream)
    ref_out, ref_grads = run(layout.prepare("sdpa_reference", needs_grad=True), [t.float() for t in inputs],
                             upstream.float())
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2, rtol=2e-2)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.float(), ref, atol=2e-2, rtol=2e-2)
    assert [call["causal"] for call in flash_double.CALLS] == [True]  # one call: every token is a prefix token
    assert flash_double.CALLS[0]["heads"] == (HEADS, KV_HEADS)


def test_torch_varlen_gets_a_causal_window(flash_double, monkeypatch) -> None:  # noqa: F811
    import torch.nn.attention.varlen as varlen

    from embodyhpc.models import attention_varlen

    seen = []

    def recording(*args, window_size=(-1, -1), **kwargs):
        seen.append(window_size)
        return varlen_attn_2_13(*args, window_size=window_size, **kwargs)

    monkeypatch.setattr(varlen, "varlen_attn", recording)
    attention_varlen._accepts.cache_clear()
    layout, where = causal_layout(interleave=False)
    inputs = qkv(layout, dtype=torch.bfloat16)
    upstream = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    plan = layout.prepare("sdpa_segments", needs_grad=True).varlen
    out, _ = run(PreparedAttention("torch_varlen", varlen=plan), inputs, upstream)
    rows, cols = zip(*real_tokens(where), strict=True)
    torch.testing.assert_close(out[rows, cols].double(), alone(*inputs, where)[rows, cols], atol=2e-2, rtol=2e-2)
    assert seen == [(-1, 0)]


def test_torch_varlen_without_a_window_refuses_causal(monkeypatch) -> None:
    import torch.nn.attention.varlen as varlen

    from embodyhpc.models import attention_varlen

    def before_windows(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        raise AssertionError("must not be called for a causal layout")

    monkeypatch.setattr(varlen, "varlen_attn", before_windows)
    attention_varlen._accepts.cache_clear()
    layout, _ = causal_layout(interleave=False)
    plan = layout.prepare("sdpa_segments").varlen
    with pytest.raises(ValueError, match="no window_size"):
        attend(*qkv(layout, dtype=torch.bfloat16), prepared=PreparedAttention("torch_varlen", varlen=plan))
    attention_varlen._accepts.cache_clear()


def test_misuse_is_refused() -> None:
    segment = torch.tensor([[0, 0, 1, 1, PAD_SEGMENT]])
    with_actions = AttentionLayout.self_attention(segment, torch.tensor([[True, False, True, True, True]]),
                                                  causal=True)
    for backend in ("sdpa_reference", "sdpa_segments"):
        with pytest.raises(ValueError, match="prefix tokens only"):
            with_actions.prepare(backend)
    with pytest.raises(ValueError, match="self-attention layout"):
        AttentionLayout(segment, segment >= -1, segment.clone(), segment >= -1, causal=True)
