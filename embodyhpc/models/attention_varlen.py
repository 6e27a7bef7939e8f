"""The prefix-LM mask as two unmasked variable-length attention calls, for kernels that only know segments.

Varlen kernels (flash-attn, torch's varlen_attn) attend fully (or causally) within each segment of a flattened
token stream, with separate segment boundaries for queries and keys. The prefix-LM mask of attention.py splits
into two such calls per segment:
  1. prefix queries over the prefix keys of their segment;
  2. action queries over all keys of their segment.
A plan gathers the query and key tokens of each call into segment-major order (tokens of a segment contiguous,
padding of a row being one more segment), records the boundaries (cu_seqlens), and scatters the outputs back to
token order. Segments without queries in a call are left out of that call, so no kernel sees an empty segment.

The plan is built once per layout (a host sync for the lengths, in AttentionLayout.prepare, before the layers)
and reused by every layer. Every kernel is called the same way, flash-attn's varlen convention:
    kernel(q [Nq, Hq, D], k [Nk, Hkv, D], v [Nk, Hkv, D], cu_q [S + 1] int32, cu_k [S + 1] int32, max_q, max_k,
           scale, causal) -> [Nq, Hq, D]
with cu_* starting at 0 and ending at the token totals, and max_* the longest segment. `sdpa_segments` is the CPU
kernel with that convention: a custom op (`embodyhpc::varlen_attention`) running one CPU flash-attention call per
segment, with its own backward from the saved log-sum-exp, as a GPU varlen kernel does. Being one opaque op, it
traces into a compiled block without graph breaks and without recompiling for new segment lengths.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from embodyhpc.models.attention import PAD_SEGMENT, AttentionLayout, repeat_kv


@dataclass(frozen=True)
class VarlenCall:
    """One unmasked varlen attention call over segment-major gathered tokens."""

    q_index: torch.Tensor  # [Nq] int64: flat (row * Tq + t) index of each gathered query
    k_index: torch.Tensor  # [Nk] int64: flat (row * Tk + t) index of each gathered key
    cu_q: torch.Tensor  # [S + 1] int32 segment boundaries over the gathered queries
    cu_k: torch.Tensor  # [S + 1] int32
    max_q: int
    max_k: int
    causal: bool = False  # each segment's queries are its keys: the kernel's causal (lower-triangle) mask


@dataclass(frozen=True)
class VarlenPlan:
    calls: tuple[VarlenCall, ...]  # the non-empty ones of (prefix queries, action queries)
    inverse: torch.Tensor  # [B * Tq] int64: row of cat(call outputs) holding each query token's output


def build_varlen_plan(layout: AttentionLayout) -> VarlenPlan:
    rows, num_q, num_k = layout.shape
    num_slots = int(max(layout.q_segment_ids.max(), layout.k_segment_ids.max())) + 2  # +1 for padding, +1 base 0
    device = layout.q_segment_ids.device
    # A key per (row, segment), ordered so that sorting by it groups tokens segment by segment, row by row.
    q_key = (torch.arange(rows, device=device)[:, None] * num_slots + layout.q_segment_ids - PAD_SEGMENT).flatten()
    k_key = (torch.arange(rows, device=device)[:, None] * num_slots + layout.k_segment_ids - PAD_SEGMENT).flatten()
    q_prefix, k_prefix = layout.q_is_prefix.flatten(), layout.k_is_prefix.flatten()
    calls = []
    for q_select, k_select in ((q_prefix, k_prefix), (~q_prefix, torch.ones_like(k_prefix))):
        if bool(q_select.any()):
            calls.append(_plan_call(q_key, q_select, k_key, k_select, causal=layout.causal))
    order = torch.cat([call.q_index for call in calls])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    if order.numel() != rows * num_q:
        raise AssertionError("every query token must be in exactly one call")
    return VarlenPlan(calls=tuple(calls), inverse=inverse)


def _plan_call(q_key: torch.Tensor, q_select: torch.Tensor, k_key: torch.Tensor,
               k_select: torch.Tensor, *, causal: bool = False) -> VarlenCall:
    q_index = q_select.nonzero().flatten()
    q_index = q_index[torch.sort(q_key[q_index], stable=True).indices]
    segments, q_counts = torch.unique_consecutive(q_key[q_index], return_counts=True)
    k_index = (k_select & torch.isin(k_key, segments)).nonzero().flatten()
    k_index = k_index[torch.sort(k_key[k_index], stable=True).indices]
    k_counts = torch.bincount(torch.searchsorted(segments, k_key[k_index]), minlength=segments.numel())
    if bool((k_counts == 0).any()):
        raise ValueError("a query token has no visible key: its segment has no prefix key (or no key at all)")
    return VarlenCall(q_index=q_index, k_index=k_index, cu_q=_cumulative(q_counts), cu_k=_cumulative(k_counts),
                      max_q=int(q_counts.max()), max_k=int(k_counts.max()), causal=causal)


def _cumulative(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def varlen_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan, kernel_name: str,
                  scale: float | None) -> torch.Tensor:
    """q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] -> [B, Tq, Hq, D] through the plan's calls of the named kernel."""
    kernel = KERNELS[kernel_name]
    q_flat, k_flat, v_flat = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    outputs = [kernel(q_flat[call.q_index], k_flat[call.k_index], v_flat[call.k_index], call.cu_q, call.cu_k,
                      call.max_q, call.max_k, scale, call.causal) for call in plan.calls]
    return torch.cat(outputs)[plan.inverse].view(q.shape)


# ---- the CPU kernel: one CPU flash-attention call per segment, forward and backward ----
def _segments(cu: torch.Tensor) -> list[int]:
    return torch.diff(cu.to(torch.int64)).tolist()


def _heads_first(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[L, H, D] -> [1, heads, L, D] (key/value heads repeated to the query heads)."""
    return repeat_kv(x, heads).transpose(0, 1)[None]


@torch.library.custom_op("embodyhpc::varlen_attention", mutates_args=())
def _varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                    scale: float | None, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    heads = q.shape[1]
    outputs, lses = [], []
    for q_seg, k_seg, v_seg in zip(q.split(_segments(cu_q)), k.split(_segments(cu_k)), v.split(_segments(cu_k)),
                                   strict=True):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_seg.transpose(0, 1)[None], _heads_first(k_seg, heads), _heads_first(v_seg, heads), 0.0, causal,
            scale=scale)
        outputs.append(out[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outputs).contiguous(), torch.cat(lses).contiguous()


@_varlen_forward.register_fake
def _(q, k, v, cu_q, cu_k, scale, causal):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("embodyhpc::varlen_attention_backward", mutates_args=())
def _varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, scale: float | None,
                     causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, kv_heads = q.shape[1], k.shape[1]
    q_lengths, k_lengths = _segments(cu_q), _segments(cu_k)
    grads_q, grads_k, grads_v = [], [], []
    for g_seg, q_seg, k_seg, v_seg, o_seg, l_seg in zip(
            grad_out.split(q_lengths), q.split(q_lengths), k.split(k_lengths), v.split(k_lengths),
            out.split(q_lengths), lse.split(q_lengths), strict=True):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g_seg.transpose(0, 1)[None], q_seg.transpose(0, 1)[None], _heads_first(k_seg, heads),
            _heads_first(v_seg, heads), o_seg.transpose(0, 1)[None], l_seg.transpose(0, 1)[None], 0.0, causal,
            scale=scale)
        grads_q.append(dq[0].transpose(0, 1))
        # repeated key/value heads: head j served query heads j*g .. j*g+g-1, so its gradient is their sum
        grads_k.append(dk[0].transpose(0, 1).unflatten(1, (kv_heads, heads // kv_heads)).sum(2))
        grads_v.append(dv[0].transpose(0, 1).unflatten(1, (kv_heads, heads // kv_heads)).sum(2))
    return torch.cat(grads_q), torch.cat(grads_k).to(k.dtype), torch.cat(grads_v).to(v.dtype)


@_varlen_backward.register_fake
def _(grad_out, q, k, v, out, lse, cu_q, cu_k, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, scale, causal = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.scale, ctx.causal = scale, causal


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = _varlen_backward(grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None, None


_varlen_forward.register_autograd(_backward, setup_context=_setup_context)


def _sdpa_segments_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=False):
    """The CPU varlen kernel (flash-attn's convention; max_q/max_k are not needed by a per-segment loop)."""
    return _varlen_forward(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, scale, causal)[0]


# ---- the GPU kernels: adapters to each library's own signature ----
def _flash_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=False):
    """flash-attn 2.8's flash_attn_varlen_func (flash_attn/flash_attn_interface.py): GQA by fewer k/v heads;
    its causal mask is aligned to the bottom right of each segment, the lower triangle when q and k are the same
    tokens (the only causal use here)."""
    from flash_attn import flash_attn_varlen_func  # availability checked by attention.resolve_backend

    return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal)


def _torch_varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal=False):
    """torch.nn.attention.varlen.varlen_attn: `enable_gqa` exists only in newer releases (2.13 has it); without it
    the key/value heads are repeated to the query heads here, which the kernel then requires. It has no causal
    flag: causal is its window_size=(-1, 0) (2.13's documented form; releases without window_size are refused)."""
    from torch.nn.attention.varlen import varlen_attn

    extra = {"scale": scale}
    if causal:
        if not _accepts(varlen_attn, "window_size"):
            raise ValueError(f"torch {torch.__version__}'s varlen_attn has no window_size, so no causal mask: set "
                             "model.attention_backend=flash_varlen or auto")
        extra["window_size"] = (-1, 0)
    if q.shape[1] == k.shape[1]:
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **extra)
    if _accepts(varlen_attn, "enable_gqa"):
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=True, **extra)
    return varlen_attn(q, repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1]), cu_q, cu_k, max_q, max_k, **extra)


@functools.lru_cache(maxsize=8)
def _accepts(function: Callable, parameter: str) -> bool:
    return parameter in inspect.signature(function).parameters


KERNELS: dict[str, Callable] = {
    "sdpa_segments": _sdpa_segments_kernel,
    "flash_varlen": _flash_varlen_kernel,
    "torch_varlen": _torch_varlen_kernel,
}
