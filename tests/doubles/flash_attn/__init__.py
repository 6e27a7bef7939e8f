"""CPU double of flash-attn 2's varlen entry point (tests only; see tests/doubles/README.md).

`flash_attn_varlen_func` as in flash-attn 2.8.3 (flash_attn/flash_attn_interface.py): q [total_q, Hq, D],
k and v [total_k, Hkv, D] (Hkv divides Hq: MQA/GQA by fewer key/value heads), cu_seqlens_q/k [batch + 1] int32
cumulative lengths, max_seqlen_q/k the longest segments, softmax_scale default D**-0.5, fp16/bf16 only, head dim
a multiple of 8 up to 256. The double checks what the real kernel would receive: int32 cu_seqlens starting at 0,
non-decreasing, ending at the token totals, as many segments for q as for k, max_seqlen equal to the longest
segment, dtypes and shapes; then computes each segment with SDPA in float32 (`causal` aligned to the bottom right
of each segment, as flash-attn 2.1+ does) (differentiable, so backward works)
and records each call in CALLS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__version__ = "2.8.3"
CALLS: list[dict] = []


def _check_cu(cu: torch.Tensor, total: int, name: str) -> list[int]:
    assert cu.dtype == torch.int32 and cu.ndim == 1 and cu.is_contiguous(), f"{name} must be contiguous 1-D int32"
    values = cu.tolist()
    assert values[0] == 0, f"{name} must start at 0, got {values[0]}"
    assert all(b >= a for a, b in zip(values, values[1:], strict=False)), f"{name} must be non-decreasing"
    assert values[-1] == total, f"{name} must end at the token total {total}, got {values[-1]}"
    return [b - a for a, b in zip(values, values[1:], strict=False)]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    assert q.ndim == k.ndim == v.ndim == 3, "q, k, v must be [total, heads, head_dim]"
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16 and bf16"
    assert k.dtype == v.dtype == q.dtype, "q, k, v must have the same dtype"
    head_dim = q.shape[-1]
    assert k.shape[-1] == v.shape[-1] == head_dim and head_dim % 8 == 0 and head_dim <= 256
    assert q.shape[1] % k.shape[1] == 0, "number of q heads must be a multiple of k/v heads"
    assert k.shape[:2] == v.shape[:2]
    q_lengths = _check_cu(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    k_lengths = _check_cu(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    assert len(q_lengths) == len(k_lengths), "cu_seqlens_q and cu_seqlens_k must have the same length"
    assert max_seqlen_q == max(q_lengths) and max_seqlen_k == max(k_lengths), (
        f"max_seqlen ({max_seqlen_q}, {max_seqlen_k}) != longest segments ({max(q_lengths)}, {max(k_lengths)})")
    assert dropout_p == 0.0 and block_table is None
    CALLS.append({"segments": len(q_lengths), "max_q": max_seqlen_q, "max_k": max_seqlen_k, "causal": causal,
                  "scale": softmax_scale, "heads": (q.shape[1], k.shape[1])})
    group = q.shape[1] // k.shape[1]
    outputs = []
    for q_seg, k_seg, v_seg in zip(q.split(q_lengths), k.split(k_lengths), v.split(k_lengths), strict=True):
        k_seg, v_seg = (t.repeat_interleave(group, dim=1) for t in (k_seg, v_seg))
        mask = None
        if causal:  # flash-attn 2.1+: the causal mask is aligned to the bottom right of the segment
            shift = k_seg.shape[0] - q_seg.shape[0]
            mask = torch.arange(k_seg.shape[0])[None, :] <= torch.arange(q_seg.shape[0])[:, None] + shift
        out = F.scaled_dot_product_attention(*(t.float().transpose(0, 1)[None] for t in (q_seg, k_seg, v_seg)),
                                             attn_mask=mask, scale=softmax_scale)
        outputs.append(out[0].transpose(0, 1).to(q.dtype))
    return torch.cat(outputs)
