"""Where every token of a (packed) GR00T batch goes.

Two token sets per sample, of different kinds:
- the VLM tokens: image patches of each camera, then the instruction's text tokens (variable length). They run
  through the LLM and the VL adapter in the packer's rows ([R, T], samples one after another, padded to the longest
  row and then to the token alignment below); `segments` keep the samples of a row apart, positions restart at 0
  per sample (RoPE).
- the action-side tokens of the DiT: [state (1), future tokens (F), action chunk (H)] = S tokens, the same count for
  every sample, so they stay dense [N, S', D] for everything but cross-attention; S' = `token_stride` >= S leaves
  S' - S alignment tokens after each sample's S (the DiT's self-attention reads the first S, the decoder reads none
  of the rest).
Cross-attention gathers each row's samples' S-token groups into query rows [R, Tq] beside the VLM rows: a varlen
call with different query and key lengths per sample (S vs that sample's VLM tokens). Its keys are the VLM rows
widened to `key_width`, so that every row holds a padding key: padding queries see a padding key and no real query
ever sees one.

Token alignment (fp8): every token stream that reaches a Linear of the blocks is padded so that its rows x tokens is
a multiple of TOKEN_ALIGNMENT (16): transformer-engine asserts it before each float8 GEMM and the CUDA `_scaled_mm`
torchao calls needs it in the weight-gradient GEMM. The VLM rows' width T, the key width and S' are each the
smallest that is >= what they hold and makes R x T, R x key_width and N x S' multiples of 16 (`aligned_width`; the
vision tower aligns its images itself). Padding tokens carry PAD_SEGMENT (attention keeps them apart from every
real token) and their outputs are dropped, so they change no real token's value (tests/models/test_groot_padding.py
against a per-sample computation without any padding). Padded for every precision: one code path, and fewer than
16 / gcd(R, 16) tokens more per row (per sample for S').

Index conventions: each gather appends one zero row to its source, so "one past the end" is padding. Built on the
host from the batch's lengths (one short loop over samples).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from embodyhpc.models.attention import PAD_SEGMENT, AttentionLayout
from embodyhpc.models.shapes import TOKEN_ALIGNMENT


@dataclass(frozen=True, eq=False)
class GrootPlan:
    num_samples: int
    tokens_per_sample: int  # S: action-side tokens of one sample
    token_stride: int  # S' >= S: action-side tokens per sample with alignment padding (N x S' % 16 == 0)
    key_width: int  # the cross-attention key rows' width (> the VLM tokens of every row, R x key_width % 16 == 0)
    vl_source: torch.Tensor  # [R, T] into cat(image tokens [N*C*P], text tokens [N*L], one zero row)
    vl_positions: torch.Tensor  # [R, T] int64, 0 on padding
    vl_segments: torch.Tensor  # [R, T] slot of the sample in its row, PAD_SEGMENT on padding
    q_rows: torch.Tensor  # [R, Tq] into the flat action-side tokens [N*S'] (+ one zero row)
    q_inverse: torch.Tensor  # [N*S'] into R*Tq (+ one zero row: alignment tokens are no query)
    q_segments: torch.Tensor  # [R, Tq]

    @cached_property
    def llm_layout(self) -> AttentionLayout:
        """The LLM: causal within each sample (a sample's tokens are contiguous and in order in its row)."""
        return AttentionLayout.causal_segments(self.vl_segments)

    @cached_property
    def vl_layout(self) -> AttentionLayout:
        """The VL adapter: bidirectional within each sample."""
        return AttentionLayout.self_attention(self.vl_segments, torch.ones_like(self.vl_segments, dtype=torch.bool))

    @cached_property
    def cross_layout(self) -> AttentionLayout:
        """DiT cross-attention: queries = action-side rows, keys = VLM rows widened to key_width with padding."""
        rows, width = self.vl_segments.shape
        pad = self.vl_segments.new_full((rows, self.key_width - width), PAD_SEGMENT)
        k_segments = torch.cat([self.vl_segments, pad], dim=1)
        return AttentionLayout(self.q_segments, self.q_segments == PAD_SEGMENT, k_segments,
                               torch.ones_like(k_segments, dtype=torch.bool))


def aligned_width(length: int, rows: int) -> int:
    """The smallest width >= length (and >= 1) with rows x width a multiple of TOKEN_ALIGNMENT."""
    step = TOKEN_ALIGNMENT // math.gcd(max(rows, 1), TOKEN_ALIGNMENT)
    return max(-(-length // step), 1) * step


def build_plan(*, rows: list[list[int]], num_image_tokens: int, text_lengths: list[int], max_text_len: int,
               tokens_per_sample: int, device: torch.device | str = "cpu") -> GrootPlan:
    """Gather indices for samples placed in `rows` (every sample exactly once; a row may be empty: all padding);
    num_image_tokens: cameras x patches per sample."""
    num_samples = len(text_lengths)
    if sorted(i for row in rows for i in row) != list(range(num_samples)) or not rows:
        raise ValueError(f"rows must place each of the {num_samples} samples exactly once, got {rows}")
    text_base = num_samples * num_image_tokens
    zero = text_base + num_samples * max_text_len
    stride = aligned_width(tokens_per_sample, num_samples)
    empty = torch.zeros(0, dtype=torch.long)
    vl_rows, q_rows = [], []
    for row in rows:
        sources, positions, segments, q_index, q_seg = [empty], [empty], [empty], [empty], [empty]
        for slot, s in enumerate(row):
            source = torch.cat([s * num_image_tokens + torch.arange(num_image_tokens),
                                text_base + s * max_text_len + torch.arange(text_lengths[s])])
            sources.append(source)
            positions.append(torch.arange(len(source)))
            segments.append(torch.full((len(source),), slot))
            q_index.append(s * stride + torch.arange(tokens_per_sample))
            q_seg.append(torch.full((tokens_per_sample,), slot))
        vl_rows.append((torch.cat(sources), torch.cat(positions), torch.cat(segments)))
        q_rows.append((torch.cat(q_index), torch.cat(q_seg)))
    num_rows, longest = len(rows), max(len(r[0]) for r in vl_rows)
    width = aligned_width(longest, num_rows)
    # a row as long as the widest has no padding key yet: one more column (then aligned) gives every row one
    key_width = width if width > longest else aligned_width(width + 1, num_rows)
    vl_source = torch.full((num_rows, width), zero, dtype=torch.long)
    vl_positions = torch.zeros((num_rows, width), dtype=torch.long)
    vl_segments = torch.full((num_rows, width), PAD_SEGMENT, dtype=torch.long)
    for r, (source, position, segment) in enumerate(vl_rows):
        vl_source[r, :len(source)], vl_positions[r, :len(source)], vl_segments[r, :len(source)] = (
            source, position, segment)
    q_width = max(max(len(q[0]) for q in q_rows), 1)
    num_flat = num_samples * stride
    q_index = torch.full((num_rows, q_width), num_flat, dtype=torch.long)
    q_segments = torch.full((num_rows, q_width), PAD_SEGMENT, dtype=torch.long)
    q_inverse = torch.full((num_flat,), num_rows * q_width, dtype=torch.long)
    for r, (index, segment) in enumerate(q_rows):
        q_index[r, :len(index)], q_segments[r, :len(index)] = index, segment
        q_inverse[index] = r * q_width + torch.arange(len(index))
    tensors = dict(vl_source=vl_source, vl_positions=vl_positions, vl_segments=vl_segments, q_rows=q_index,
                   q_inverse=q_inverse, q_segments=q_segments)
    return GrootPlan(num_samples=num_samples, tokens_per_sample=tokens_per_sample, token_stride=stride,
                     key_width=key_width, **{k: v.to(device) for k, v in tensors.items()})


def to_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[M, ...] -> [R, T, ...] (zeros on padding)."""
    return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])[rows]


def from_rows(rowed: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """[R, T, ...] -> [M, ...] in flat order (zeros where `inverse` points one past the end: alignment tokens)."""
    flat = rowed.flatten(0, 1)
    return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])[inverse]
