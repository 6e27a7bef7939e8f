"""Attention backends: every CPU-capable backend equals the dense-mask reference (forward and gradients) on packed
batches; the mask itself equals a brute-force per-token rule; GPU backends are checked in `gpu` tests."""

from __future__ import annotations

import random

import pytest
import torch

from embodyhpc.errors import ConfigError
from embodyhpc.models.attention import PAD_SEGMENT, AttentionLayout, attend, resolve_backend

# Samples per row as (prefix tokens, action tokens); rows padded to the longest. 3+ samples of different lengths.
ROWS = [[(5, 3), (2, 4), (7, 2)], [(9, 5)], [(3, 1), (1, 6), (4, 4), (2, 2)]]
NUM_Q_HEADS, HEAD_DIM = 4, 8
TOL = {"atol": 1e-5, "rtol": 1e-5}


def contiguous_layout(rows=ROWS) -> tuple[AttentionLayout, list[list[tuple[int, int, list[int]]]]]:
    """Samples contiguous within a row ([prefix, actions] each), padding at the end: the single-stream form."""
    length = max(sum(p + a for p, a in row) for row in rows) + 2
    segment = torch.full((len(rows), length), PAD_SEGMENT)
    is_prefix = torch.zeros(len(rows), length, dtype=torch.bool)
    where = []
    for r, row in enumerate(rows):
        start, placed = 0, []
        for slot, (p, a) in enumerate(row):
            segment[r, start:start + p + a] = slot
            is_prefix[r, start:start + p] = True
            placed.append((p, a, list(range(start, start + p + a))))
            start += p + a
        where.append(placed)
    return AttentionLayout.self_attention(segment, is_prefix), where


def two_stream_layout(rows=ROWS, seed: int = 0) -> AttentionLayout:
    """Prefix stream then action stream, as the pi0.5 model lays tokens out; padding scattered, order shuffled."""
    rng = random.Random(seed)
    segment, is_prefix = [], []
    for row in rows:
        tokens = [(slot, True) for slot, (p, _) in enumerate(row) for _ in range(p)]
        tokens += [(slot, False) for slot, (_, a) in enumerate(row) for _ in range(a)]
        tokens += [(PAD_SEGMENT, True)] * 3
        rng.shuffle(tokens)
        segment.append([s for s, _ in tokens])
        is_prefix.append([f for _, f in tokens])
    width = max(len(s) for s in segment)
    for s, f in zip(segment, is_prefix, strict=True):
        s += [PAD_SEGMENT] * (width - len(s))
        f += [True] * (width - len(f))
    return AttentionLayout.self_attention(torch.tensor(segment), torch.tensor(is_prefix))


def qkv(layout: AttentionLayout, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    rows, num_q, num_k = layout.shape
    q = torch.randn(rows, num_q, NUM_Q_HEADS, HEAD_DIM, generator=g, dtype=dtype)
    k = torch.randn(rows, num_k, 1, HEAD_DIM, generator=g, dtype=dtype)
    v = torch.randn(rows, num_k, 1, HEAD_DIM, generator=g, dtype=dtype)
    return [t.to(device).requires_grad_() for t in (q, k, v)]


def run_with_grads(backend: str, layout: AttentionLayout, inputs, upstream: torch.Tensor):
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    out = attend(q, k, v, layout=layout, backend=backend)
    out.backward(upstream)
    return out.detach(), [t.grad for t in (q, k, v)]


def brute_force_mask(layout: AttentionLayout) -> torch.Tensor:
    rows, num_q, num_k = layout.shape
    mask = torch.zeros(rows, num_q, num_k, dtype=torch.bool)
    for b in range(rows):
        for i in range(num_q):
            for j in range(num_k):
                same = int(layout.q_segment_ids[b, i]) == int(layout.k_segment_ids[b, j])
                q_is_action = not bool(layout.q_is_prefix[b, i])
                mask[b, i, j] = same and (bool(layout.k_is_prefix[b, j]) or q_is_action)
    return mask


def test_mask_matches_the_rule_token_by_token() -> None:
    layout, where = contiguous_layout()
    assert torch.equal(layout.dense_mask, brute_force_mask(layout))
    mask = layout.dense_mask
    for r, placed in enumerate(where):
        for p, _, tokens in placed:
            prefix, actions = tokens[:p], tokens[p:]
            others = [t for t in range(mask.shape[1]) if t not in tokens]
            for i in prefix:
                assert mask[r, i, prefix].all() and not mask[r, i, actions].any() and not mask[r, i, others].any()
            for i in actions:
                assert mask[r, i, tokens].all() and not mask[r, i, others].any()
    shuffled = two_stream_layout()
    assert torch.equal(shuffled.dense_mask, brute_force_mask(shuffled))


@pytest.mark.parametrize("make_layout", [lambda: contiguous_layout()[0], two_stream_layout],
                         ids=["contiguous", "two_stream"])
def test_segments_backend_equals_reference_forward_and_backward(make_layout) -> None:
    layout = make_layout()
    inputs = qkv(layout)
    upstream = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = run_with_grads("sdpa_reference", layout, inputs, upstream)
    out, grads = run_with_grads("sdpa_segments", layout, inputs, upstream)
    torch.testing.assert_close(out, ref_out, **TOL)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, **TOL)


def test_reference_equals_each_sample_alone_in_float64() -> None:
    """Packing isolates samples: each sample's output equals attention over that sample alone."""
    layout, where = contiguous_layout()
    q, k, v = (t.detach().double() for t in qkv(layout))
    out = attend(q, k, v, layout=layout, backend="sdpa_reference")
    for r, placed in enumerate(where):
        for p, _, tokens in placed:
            alone = AttentionLayout.self_attention(torch.zeros(1, len(tokens), dtype=torch.long),
                                                   torch.arange(len(tokens))[None] < p)
            expected = attend(q[r:r + 1, tokens], k[r:r + 1, tokens], v[r:r + 1, tokens], layout=alone,
                              backend="sdpa_reference")
            torch.testing.assert_close(out[r:r + 1, tokens], expected, atol=1e-12, rtol=1e-12)


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_flex_equals_reference_forward_on_cpu() -> None:
    layout = two_stream_layout()
    q, k, v = qkv(layout)  # requiring grad, as parameters' outputs do: fine under no_grad
    with torch.no_grad():
        ref = attend(q, k, v, layout=layout, backend="sdpa_reference")
        out = attend(q, k, v, layout=layout, backend="flex")
    torch.testing.assert_close(out, ref, **TOL)


def cached_inference_layout() -> tuple[AttentionLayout, AttentionLayout, torch.Tensor]:
    """Queries = the action tokens only, keys = all tokens (prefix cache + actions) of the two-stream layout."""
    full = two_stream_layout()
    action_cols = (~full.q_is_prefix).any(0).nonzero().flatten()
    cross = AttentionLayout(full.q_segment_ids[:, action_cols], full.q_is_prefix[:, action_cols],
                            full.k_segment_ids, full.k_is_prefix)
    return full, cross, action_cols


@pytest.mark.parametrize("backend", ["sdpa_reference", "sdpa_segments"])
def test_action_queries_over_cached_keys_equal_full_attention(backend: str) -> None:
    full, cross, cols = cached_inference_layout()
    q, k, v = (t.detach() for t in qkv(full))
    expected = attend(q, k, v, layout=full, backend="sdpa_reference")[:, cols]
    got = attend(q[:, cols], k, v, layout=cross, backend=backend)
    real = ~cross.q_is_prefix  # columns mix action and padding tokens; padding outputs are unused
    torch.testing.assert_close(got[real], expected[real], **TOL)


def test_single_stream_packing_form_gives_the_same_layout() -> None:
    layout, where = contiguous_layout()
    positions = torch.zeros_like(layout.q_segment_ids)
    prefix_lens = torch.zeros(len(ROWS), max(len(r) for r in ROWS), dtype=torch.int32)
    for r, placed in enumerate(where):
        for slot, (p, _, tokens) in enumerate(placed):
            positions[r, tokens] = torch.arange(len(tokens))
            prefix_lens[r, slot] = p
    other = AttentionLayout.from_prefix_lengths(layout.q_segment_ids.int(), positions, prefix_lens)
    assert torch.equal(other.dense_mask, layout.dense_mask)


def test_auto_and_unavailable_backends_on_cpu() -> None:
    assert resolve_backend("auto", device="cpu", needs_grad=True) == "sdpa_reference"
    assert resolve_backend("auto", device="cpu", needs_grad=False) == "sdpa_reference"
    assert resolve_backend("auto", device="cpu", needs_grad=True, packed=True) == "sdpa_segments"
    assert contiguous_layout()[0].samples_per_row == 8 / 3
    assert resolve_backend("flex", device="cpu", needs_grad=False) == "flex"
    with pytest.raises(ConfigError, match="model.attention_backend: flex cannot run here: .*no backward on CPU"):
        resolve_backend("flex", device="cpu", needs_grad=True)
    for name in ("flash_varlen", "torch_varlen"):
        with pytest.raises(ConfigError, match=f"{name} cannot run here: .*CUDA"):
            resolve_backend(name, device="cpu", needs_grad=False)
    with pytest.raises(ConfigError, match="unknown attention backend 'fast'"):
        resolve_backend("fast", device="cpu", needs_grad=False)
    layout, _ = contiguous_layout()
    q, k, v = qkv(layout)
    with pytest.raises(ConfigError, match="no backward on CPU"):
        attend(q, k, v, layout=layout, backend="flex")


def test_auto_on_cuda_follows_availability_and_dtype(monkeypatch) -> None:
    """Resolution only: no GPU needed. flash-attn and torch's varlen kernels take fp16/bf16 only."""
    import embodyhpc.models.attention as attention

    for installed, expected in ((True, "flash_varlen"), (False, "torch_varlen")):
        monkeypatch.setattr(attention, "_flash_attn_installed", lambda installed=installed: installed)
        assert resolve_backend("auto", device="cuda", needs_grad=True, dtype=torch.bfloat16) == expected
        assert resolve_backend("auto", device="cuda", needs_grad=True, dtype=torch.float32) == "flex"
    with pytest.raises(ConfigError, match="torch_varlen needs float16 or bfloat16 inputs"):
        resolve_backend("torch_varlen", device="cuda", needs_grad=True, dtype=torch.float32)


def test_a_query_without_visible_keys_is_rejected() -> None:
    # Queries of segment 0 are action tokens, but the keys side holds no token of segment 0.
    layout = AttentionLayout(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.bool),
                             torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no visible key"):
        _ = layout.dense_mask
    with pytest.raises(ValueError, match="no visible key"):
        _ = layout.varlen_plan


@pytest.mark.gpu  # skipped without a GPU; with one, a backend that cannot run (flash-attn missing) fails
@pytest.mark.parametrize("backend", ["flash_varlen", "torch_varlen", "flex"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_backend_equals_reference(backend: str, dtype: torch.dtype) -> None:
    from embodyhpc.models.attention import backend_unavailable_reason

    reason = backend_unavailable_reason(backend, "cuda", dtype)
    assert reason is None, f"{backend} cannot run on this GPU node: {reason}"
    layout = two_stream_layout()
    layout = AttentionLayout(*(t.cuda() for t in (layout.q_segment_ids, layout.q_is_prefix,
                                                   layout.k_segment_ids, layout.k_is_prefix)))
    inputs = qkv(layout, dtype=dtype, device="cuda")
    upstream = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref_out, ref_grads = run_with_grads("sdpa_reference", layout, ref_inputs, upstream.float())
    out, grads = run_with_grads(backend, layout, inputs, upstream)
    tol = {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out.float(), ref_out, **tol)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.float(), ref_grad, **tol)
