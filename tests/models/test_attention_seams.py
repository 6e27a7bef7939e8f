"""The GPU attention kernels' seams, driven on the CPU: everything around each kernel call is our code and runs
here (planning, gathers, cu_seqlens, max lengths, head layout, scale, scatter, backward), with a double at the
kernel call that checks what the real kernel would receive and computes with SDPA.

Doubles: flash-attn 2.8.3's flash_attn_varlen_func (tests/doubles/flash_attn), the flash-attn 4 install layout
(tests/doubles/flash_attn4), torch 2.13's torch.nn.attention.varlen.varlen_attn and the signature it had before
pytorch/pytorch#179468 added enable_gqa (April 2026: torch <= 2.11), and torch 2.13's flex_attention (whose CPU
implementation has no backward).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from embodyhpc.errors import ConfigError
from embodyhpc.models import attention
from embodyhpc.models.attention import PreparedAttention, attend, resolve_backend
from tests.helpers import DOUBLES, drop_modules
from tests.models.test_attention import qkv, two_stream_layout

TOL = {"atol": 2e-2, "rtol": 2e-2}  # bf16 kernels against the float32 reference


@pytest.fixture
def flash_double(monkeypatch):
    monkeypatch.syspath_prepend(str(DOUBLES))
    drop_modules("flash_attn")
    attention._flash_attn_installed.cache_clear()
    import flash_attn

    flash_attn.CALLS.clear()
    yield flash_attn
    drop_modules("flash_attn")
    attention._flash_attn_installed.cache_clear()


def reference(layout, inputs, upstream):
    q, k, v = (t.detach().float().requires_grad_() for t in inputs)
    out = attend(q, k, v, layout=layout, backend="sdpa_reference")
    out.backward(upstream.float())
    return out.detach(), [t.grad for t in (q, k, v)]


def through(backend: str, layout, inputs, upstream, **prepare):
    """attend with `backend` forced at the planning step (the CUDA-only availability check is the whole branch
    skipped: the plan is what prepare() builds for a varlen backend)."""
    base = layout.prepare("sdpa_segments", needs_grad=True) if backend != "flex" else None
    prepared = (PreparedAttention(backend, varlen=base.varlen) if base is not None
                else PreparedAttention("flex", block_mask=layout.flex_block_mask))
    q, k, v = (t.detach().clone().requires_grad_() for t in inputs)
    out = attend(q, k, v, prepared=prepared)
    out.backward(upstream)
    return out.detach(), [t.grad for t in (q, k, v)]


def bf16_case(seed: int = 0):
    layout = two_stream_layout(seed=seed)
    inputs = qkv(layout, dtype=torch.bfloat16, seed=seed)
    upstream = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(seed + 1)).bfloat16()
    return layout, inputs, upstream


def assert_matches_reference(got, expected) -> None:
    out, grads = got
    ref_out, ref_grads = expected
    torch.testing.assert_close(out.float(), ref_out, **TOL)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad.float(), ref_grad, **TOL)


def test_flash_varlen_gets_valid_cu_seqlens_and_max_lengths_and_matches_the_reference(flash_double) -> None:
    layout, inputs, upstream = bf16_case()
    assert_matches_reference(through("flash_varlen", layout, inputs, upstream), reference(layout, inputs, upstream))
    plan = layout.varlen_plan
    assert len(flash_double.CALLS) == len(plan.calls) == 2  # prefix queries, action queries
    for call, seen in zip(plan.calls, flash_double.CALLS, strict=True):
        lengths = torch.diff(call.cu_q).tolist()
        assert seen["segments"] == len(lengths) and seen["max_q"] == max(lengths) and not seen["causal"]
        assert seen["heads"] == (4, 1)  # multi-query: k/v keep their one head, no repeat


def test_the_flash_double_refuses_cu_seqlens_without_the_leading_zero(flash_double, monkeypatch) -> None:
    """Dropping the leading 0 passed every CPU test before the double existed: the per-segment loop read only the
    lengths. The plan's own boundaries are checked the same way by the test above."""
    from embodyhpc.models import attention_varlen

    monkeypatch.setattr(attention_varlen, "_cumulative", lambda counts: counts.cumsum(0).to(torch.int32))
    layout, inputs, upstream = bf16_case()
    with pytest.raises(AssertionError, match="cu_seqlens_q must"):
        through("flash_varlen", layout, inputs, upstream)


def _check_torch_varlen_inputs(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    from flash_attn import _check_cu  # the same boundary checks as the flash double

    q_lengths = _check_cu(cu_seq_q, query.shape[0], "cu_seq_q")
    k_lengths = _check_cu(cu_seq_k, key.shape[0], "cu_seq_k")
    assert max_q == max(q_lengths) and max_k == max(k_lengths)
    assert query.dtype in (torch.float16, torch.bfloat16)
    return q_lengths, k_lengths


def _segments_sdpa(query, key, value, q_lengths, k_lengths, scale, window_size=(-1, -1)):
    assert tuple(window_size) in ((-1, -1), (-1, 0)), f"only full and causal windows are used, got {window_size}"
    causal = tuple(window_size) == (-1, 0)  # torch 2.13's doc: (-1, 0) is causal attention
    group = query.shape[1] // key.shape[1]
    outputs = []
    for q_seg, k_seg, v_seg in zip(query.split(q_lengths), key.split(k_lengths), value.split(k_lengths),
                                   strict=True):
        k_seg, v_seg = (t.repeat_interleave(group, dim=1) for t in (k_seg, v_seg))
        assert not causal or q_seg.shape[0] == k_seg.shape[0]
        out = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q_seg, k_seg, v_seg)),
                                             scale=scale, is_causal=causal)
        outputs.append(out[0].transpose(0, 1).to(query.dtype))
    return torch.cat(outputs)


def varlen_attn_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """torch 2.13's signature and head rule (torch/nn/attention/varlen.py): fewer k/v heads need enable_gqa."""
    if not enable_gqa and query.size(1) != key.size(1):
        raise ValueError("Expect query and key/value to have the same number of heads; try enable_gqa=True")
    return _segments_sdpa(query, key, value, *_check_torch_varlen_inputs(query, key, value, cu_seq_q, cu_seq_k,
                                                                         max_q, max_k), scale, window_size)


def varlen_attn_before_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                           window_size=(-1, -1)):
    """The signature before enable_gqa (pytorch/pytorch#179468): equal head counts only."""
    if query.size(1) != key.size(1):
        raise ValueError("Expect query and key/value to have the same number of heads")
    return _segments_sdpa(query, key, value, *_check_torch_varlen_inputs(query, key, value, cu_seq_q, cu_seq_k,
                                                                         max_q, max_k), scale, window_size)


@pytest.mark.parametrize("double", [varlen_attn_2_13, varlen_attn_before_gqa])
def test_torch_varlen_is_called_with_the_signature_the_installed_torch_has(flash_double, monkeypatch,
                                                                          double) -> None:
    import torch.nn.attention.varlen as varlen

    from embodyhpc.models import attention_varlen

    monkeypatch.setattr(varlen, "varlen_attn", double)
    attention_varlen._accepts.cache_clear()
    layout, inputs, upstream = bf16_case(seed=3)
    assert_matches_reference(through("torch_varlen", layout, inputs, upstream), reference(layout, inputs, upstream))


def test_flash_attn_4_alone_does_not_count_as_flash_attn(monkeypatch) -> None:
    """flash-attn 4 installs flash_attn.cute only: `import flash_attn` works, flash-attn 2's function is absent.
    `auto` must fall through to torch's varlen kernel instead of failing at the first attention call."""
    monkeypatch.syspath_prepend(str(DOUBLES / "flash_attn4"))
    drop_modules("flash_attn")
    attention._flash_attn_installed.cache_clear()
    try:
        import flash_attn

        assert "flash_attn4" in str(list(flash_attn.__path__)[0])
        assert resolve_backend("auto", device="cuda", needs_grad=True, dtype=torch.bfloat16) == "torch_varlen"
        with pytest.raises(ConfigError, match="flash_varlen cannot run here: flash-attn 2 is not installed.*4"):
            resolve_backend("flash_varlen", device="cuda", needs_grad=True, dtype=torch.bfloat16)
    finally:
        drop_modules("flash_attn")
        attention._flash_attn_installed.cache_clear()


def flex_attention_double(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                          return_lse=False, kernel_options=None, *, return_aux=None):
    """torch 2.13's flex_attention signature ([B, H, L, E] layout), computed densely from the block mask's
    mask_mod with SDPA, so that it has a backward on the CPU."""
    batch, heads, length, _ = query.shape
    assert score_mod is None and not return_lse
    assert enable_gqa or heads == key.shape[1], "fewer k/v heads need enable_gqa=True"
    mask = create_mask(block_mask.mask_mod, batch, None, length, key.shape[2], device=query.device)
    group = heads // key.shape[1]
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def test_flex_training_goes_through_the_compiled_kernel_with_gradients(monkeypatch) -> None:
    """On GPUs flex trains through torch.compile(flex_attention, dynamic=True); here the same wrapper compiles the
    double (eager backend) and the backward flows through it."""
    from torch.nn.attention import flex_attention as flex

    monkeypatch.setattr(flex, "flex_attention", flex_attention_double)
    attention._compile_flex.cache_clear()
    try:
        layout = two_stream_layout(seed=5)
        inputs = qkv(layout, seed=5)
        upstream = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(6))
        got = through("flex", layout, inputs, upstream)
        out, grads = got
        ref_out, ref_grads = reference(layout, inputs, upstream)
        real = ~layout.q_is_prefix | (layout.q_segment_ids != -1)  # padding rows see only padding: both agree too
        torch.testing.assert_close(out[real], ref_out[real], atol=1e-5, rtol=1e-5)
        for grad, ref_grad in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)
    finally:
        attention._compile_flex.cache_clear()


def test_flex_compiles_once_for_every_shape(monkeypatch) -> None:
    """dynamic=False compiled every new (B, Tq, Tk) again and fell back to the unfused path after 8."""
    from embodyhpc.parallel.compile_stats import CompileStats

    stats = CompileStats("eager")
    monkeypatch.setattr(attention, "FLEX_COMPILE_BACKEND", stats.backend_for("flex"))
    attention._compile_flex.cache_clear()
    try:
        for seed, rows in enumerate(([[(5, 3), (2, 4)], [(9, 5)]], [[(3, 1), (1, 6), (4, 4)]],
                                     [[(7, 2)], [(2, 2), (6, 3)], [(4, 4)]], [[(11, 7), (3, 3)]])):
            layout = two_stream_layout(rows, seed=seed)
            with torch.no_grad():
                attend(*qkv(layout, seed=seed), prepared=PreparedAttention("flex", block_mask=layout.flex_block_mask))
        counts = stats.report()["flex"]
        assert counts["graphs"] <= 2 and counts["recompiles"] <= 1, counts
    finally:
        attention._compile_flex.cache_clear()


def test_the_tiny_model_trains_through_the_flash_seam(flash_double, monkeypatch, tiny_cfg) -> None:
    """The whole model path to the kernel: planning in the model, gathers and scatters in the layers, the flash
    adapter, backward through it; flash_varlen's CUDA-only availability is the branch monkeypatched."""
    from embodyhpc.models import build_model
    from tests.models.conftest import make_batch, make_samples

    real_reason = attention.backend_unavailable_reason
    monkeypatch.setattr(attention, "backend_unavailable_reason",
                        lambda name, device_type, dtype=None: None if name == "flash_varlen"
                        else real_reason(name, device_type, dtype))
    batch = make_batch(tiny_cfg, make_samples(3), rows=[[0, 1], [2]])
    noise = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(0))
    time = torch.tensor([0.3, 0.6, 0.9])
    losses = {}
    for backend in ("sdpa_reference", "flash_varlen"):
        torch.manual_seed(0)
        model = build_model(tiny_cfg).to(torch.bfloat16)
        model.attention_backend = backend
        loss = model(batch, noise=noise, time=time).loss
        loss.backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        losses[backend] = loss.item()
    assert flash_double.CALLS  # the kernel really ran
    assert losses["flash_varlen"] == pytest.approx(losses["sdpa_reference"], rel=2e-2)
