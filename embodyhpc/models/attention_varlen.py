"""The prefix-LM mask as two unmasked variable-length attention calls, for kernels that only know segments.

Varlen kernels (flash-attn, torch's varlen_attn) attend fully within each segment of a flattened token stream,
with separate segment boundaries for queries and keys. The prefix-LM mask of attention.py splits into two such
calls per segment:
  1. prefix queries over the prefix keys of their segment;
  2. action queries over all keys of their segment.
A plan gathers the query and key tokens of each call into segment-major order (tokens of a segment contiguous,
padding of a row being one more segment), records the boundaries (cu_seqlens), and scatters the outputs back to
token order. Segments without queries in a call are left out of that call, so no kernel sees an empty segment.

The plan is built once per layout (a host sync for the lengths) and reused by every layer. `sdpa_segments` runs
the same plan with a per-segment SDPA loop, which is how the CPU tests check the plan the GPU kernels use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
    lengths_q: list[int]  # per segment (for the CPU loop kernel)
    lengths_k: list[int]


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
            calls.append(_plan_call(q_key, q_select, k_key, k_select))
    order = torch.cat([call.q_index for call in calls])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=device)
    if order.numel() != rows * num_q:
        raise AssertionError("every query token must be in exactly one call")
    return VarlenPlan(calls=tuple(calls), inverse=inverse)


def _plan_call(q_key: torch.Tensor, q_select: torch.Tensor, k_key: torch.Tensor,
               k_select: torch.Tensor) -> VarlenCall:
    q_index = q_select.nonzero().flatten()
    q_index = q_index[torch.sort(q_key[q_index], stable=True).indices]
    segments, q_counts = torch.unique_consecutive(q_key[q_index], return_counts=True)
    k_index = (k_select & torch.isin(k_key, segments)).nonzero().flatten()
    k_index = k_index[torch.sort(k_key[k_index], stable=True).indices]
    k_counts = torch.bincount(torch.searchsorted(segments, k_key[k_index]), minlength=segments.numel())
    lengths_q, lengths_k = q_counts.tolist(), k_counts.tolist()
    if 0 in lengths_k:
        raise ValueError("a query token has no visible key: its segment has no prefix key (or no key at all)")
    return VarlenCall(q_index=q_index, k_index=k_index, cu_q=_cumulative(q_counts), cu_k=_cumulative(k_counts),
                      max_q=max(lengths_q), max_k=max(lengths_k), lengths_q=lengths_q, lengths_k=lengths_k)


def _cumulative(counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def varlen_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan, kernel: Callable,
                  scale: float | None) -> torch.Tensor:
    """q [B, Tq, Hq, D], k/v [B, Tk, Hkv, D] -> [B, Tq, Hq, D] through the plan's calls of `kernel`."""
    rows, num_q = q.shape[:2]
    q_flat, k_flat, v_flat = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    outputs = [kernel(q_flat[call.q_index], k_flat[call.k_index], v_flat[call.k_index], call, scale)
               for call in plan.calls]
    return torch.cat(outputs)[plan.inverse].view(rows, num_q, *q.shape[2:])


def _sdpa_segments_kernel(q, k, v, call: VarlenCall, scale):
    """[Nq, Hq, D] over [Nk, Hkv, D], one unmasked SDPA per segment (CPU-capable, forward and backward)."""
    outputs = []
    for q_seg, k_seg, v_seg in zip(q.split(call.lengths_q), k.split(call.lengths_k), v.split(call.lengths_k),
                                   strict=True):
        k_seg, v_seg = repeat_kv(k_seg, q.shape[1]), repeat_kv(v_seg, q.shape[1])
        out = F.scaled_dot_product_attention(q_seg.transpose(0, 1)[None], k_seg.transpose(0, 1)[None],
                                             v_seg.transpose(0, 1)[None], scale=scale)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs)


def _flash_varlen_kernel(q, k, v, call: VarlenCall, scale):
    from flash_attn import flash_attn_varlen_func  # CUDA only; availability checked by attention.resolve_backend

    return flash_attn_varlen_func(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, softmax_scale=scale,
                                  causal=False)


def _torch_varlen_kernel(q, k, v, call: VarlenCall, scale):
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, scale=scale,
                       enable_gqa=q.shape[1] != k.shape[1])


KERNELS: dict[str, Callable] = {
    "sdpa_segments": _sdpa_segments_kernel,
    "flash_varlen": _flash_varlen_kernel,
    "torch_varlen": _torch_varlen_kernel,
}
