"""The DiT's cross-attention over packed VLM rows: a varlen call whose query and key lengths differ per sample
(1 + F + H action-side tokens vs that sample's image + instruction tokens), through the attention backend seam,
against a per-sample CPU reference (plain SDPA over the sample's own tokens, nothing else)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from embodyhpc.models.attention import PreparedAttention, attend
from embodyhpc.models.groot.plan import build_plan, from_rows, to_rows
from tests.models.test_attention_seams import flash_double  # noqa: F401  (fixture)

TEXT = [7, 30, 1, 12, 5]  # instruction tokens per sample
IMAGE, S, HEADS, DIM = 16, 21, 4, 8  # image tokens per sample, action-side tokens per sample


def plan(rows):
    return build_plan(rows=rows, num_image_tokens=IMAGE, text_lengths=TEXT, max_text_len=max(TEXT),
                      tokens_per_sample=S)


def per_sample_reference(q, keys, values):
    """q [N, S, H, D]; keys/values: per sample [Lk_i, H, D] -> [N, S, H, D]."""
    outs = [F.scaled_dot_product_attention(q[i].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
            for i, (k, v) in enumerate(zip(keys, values, strict=True))]
    return torch.stack(outs)


def inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(TEXT), S, HEADS, DIM, generator=g)
    keys = [torch.randn(IMAGE + n, HEADS, DIM, generator=g) for n in TEXT]
    values = [torch.randn(IMAGE + n, HEADS, DIM, generator=g) for n in TEXT]
    return q.to(dtype), [k.to(dtype) for k in keys], [v.to(dtype) for v in values]


def rows_of(p, tensors):
    """Per-sample key tensors ([image tokens, then text tokens]) gathered into the plan's VLM rows, plus the padding
    columns up to the plan's key width, the way the model gathers its features (a source of all image tokens, then
    all text slots)."""
    longest = max(TEXT)
    images = torch.cat([t[:IMAGE] for t in tensors])
    text = torch.cat([F.pad(t[IMAGE:], (0, 0, 0, 0, 0, longest - (t.shape[0] - IMAGE))) for t in tensors])
    source = torch.cat([images, text, images.new_zeros(1, *images.shape[1:])])
    rowed = source[p.vl_source]
    return F.pad(rowed, (0, 0, 0, 0, 0, p.key_width - rowed.shape[1]))


def cross_attend(p, q, keys, values, prepared):
    """q [N, S, H, D] laid out as the model lays out its action-side tokens (S' per sample, plan.token_stride),
    attended in rows, back to [N, S, H, D]."""
    strided = F.pad(q, (0, 0, 0, 0, 0, p.token_stride - S))
    out = attend(to_rows(strided.flatten(0, 1), p.q_rows), rows_of(p, keys), rows_of(p, values), prepared=prepared)
    got = from_rows(out, p.q_inverse).unflatten(0, (len(TEXT), p.token_stride))
    assert not got[:, S:].any()  # the alignment tokens are no query
    return got[:, :S]


@pytest.mark.parametrize("rows", [[[0], [1], [2], [3], [4]], [[0, 2, 4], [1, 3]], [[1, 0, 2, 3, 4]]])
@pytest.mark.parametrize("backend", ["sdpa_reference", "sdpa_segments"])
def test_packed_cross_attention_equals_each_sample_alone(rows, backend):
    p = plan(rows)
    q, keys, values = inputs()
    got = cross_attend(p, q, keys, values, p.cross_layout.prepare(backend))
    torch.testing.assert_close(got, per_sample_reference(q, keys, values), rtol=1e-5, atol=1e-5)


def test_the_varlen_plan_has_different_query_and_key_lengths_per_sample():
    p = plan([[0, 2, 4], [1, 3]])
    call, = p.cross_layout.varlen_plan.calls[-1:]  # the real queries' call (the first serves padding queries)
    assert torch.diff(call.cu_q).tolist() == [S] * 5
    assert torch.diff(call.cu_k).tolist() == [IMAGE + TEXT[i] for i in (0, 2, 4, 1, 3)]


def test_through_the_flash_attn_kernel_seam(flash_double):  # noqa: F811
    p = plan([[0, 2, 4], [1, 3]])
    q, keys, values = inputs(torch.bfloat16)
    varlen = p.cross_layout.prepare("sdpa_segments").varlen
    got = cross_attend(p, q, keys, values, PreparedAttention("flash_varlen", varlen=varlen))
    reference = per_sample_reference(q.float(), [k.float() for k in keys], [v.float() for v in values])
    torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2)
    assert any(call["max_q"] == S and call["max_k"] == IMAGE + max(TEXT) for call in flash_double.CALLS)
