"""Where every token of a (packed) GR00T batch goes.

Two token sets per sample, of different kinds:
- the VLM tokens: image patches of each camera, then the instruction's text tokens (variable length). They run
  through the LLM and the VL adapter in the packer's rows ([R, T], samples one after another, padded to the longest
  row); `segments` keep the samples of a row apart, positions restart at 0 per sample (RoPE).
- the action-side tokens of the DiT: [state (1), future tokens (F), action chunk (H)] = S tokens, the same count for
  every sample, so they stay dense [N, S, D] for everything but cross-attention.
Cross-attention gathers each row's samples' S-token groups into query rows [R, Tq] beside the VLM rows [R, T]: a
varlen call with different query and key lengths per sample (S vs that sample's VLM tokens). The key rows get one
padding column more, so that padding queries see a padding key and no real query ever sees one.

Index conventions as in pi0.5's plan: each gather appends one zero row to its source, so "one past the end" is
padding. Built on the host from the batch's lengths (one short loop over samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from embodyhpc.models.attention import PAD_SEGMENT, AttentionLayout


@dataclass(frozen=True, eq=False)
class GrootPlan:
    num_samples: int
    tokens_per_sample: int  # S: action-side tokens of one sample
    vl_source: torch.Tensor  # [R, T] into cat(image tokens [N*C*P], text tokens [N*L], one zero row)
    vl_positions: torch.Tensor  # [R, T] int64, 0 on padding
    vl_segments: torch.Tensor  # [R, T] slot of the sample in its row, PAD_SEGMENT on padding
    q_rows: torch.Tensor  # [R, Tq] into the flat action-side tokens [N*S] (+ one zero row)
    q_inverse: torch.Tensor  # [N*S] into R*Tq
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
        """DiT cross-attention: queries = action-side rows, keys = VLM rows plus one padding column."""
        pad = self.vl_segments.new_full((self.vl_segments.shape[0], 1), PAD_SEGMENT)
        k_segments = torch.cat([self.vl_segments, pad], dim=1)
        return AttentionLayout(self.q_segments, self.q_segments == PAD_SEGMENT, k_segments,
                               torch.ones_like(k_segments, dtype=torch.bool))


def build_plan(*, rows: list[list[int]], num_image_tokens: int, text_lengths: list[int], max_text_len: int,
               tokens_per_sample: int, device: torch.device | str = "cpu") -> GrootPlan:
    """Gather indices for samples placed in `rows` (every sample exactly once); num_image_tokens: cameras x
    patches per sample."""
    num_samples = len(text_lengths)
    if sorted(i for row in rows for i in row) != list(range(num_samples)):
        raise ValueError(f"rows must place each of the {num_samples} samples exactly once, got {rows}")
    text_base = num_samples * num_image_tokens
    zero = text_base + num_samples * max_text_len
    vl_rows, q_rows = [], []
    for row in rows:
        sources, positions, segments, q_index, q_seg = [], [], [], [], []
        for slot, s in enumerate(row):
            source = torch.cat([s * num_image_tokens + torch.arange(num_image_tokens),
                                text_base + s * max_text_len + torch.arange(text_lengths[s])])
            sources.append(source)
            positions.append(torch.arange(len(source)))
            segments.append(torch.full((len(source),), slot))
            q_index.append(s * tokens_per_sample + torch.arange(tokens_per_sample))
            q_seg.append(torch.full((tokens_per_sample,), slot))
        vl_rows.append((torch.cat(sources), torch.cat(positions), torch.cat(segments)))
        q_rows.append((torch.cat(q_index), torch.cat(q_seg)))
    width = max(len(r[0]) for r in vl_rows)
    num_rows = len(rows)
    vl_source = torch.full((num_rows, width), zero, dtype=torch.long)
    vl_positions = torch.zeros((num_rows, width), dtype=torch.long)
    vl_segments = torch.full((num_rows, width), PAD_SEGMENT, dtype=torch.long)
    for r, (source, position, segment) in enumerate(vl_rows):
        vl_source[r, :len(source)], vl_positions[r, :len(source)], vl_segments[r, :len(source)] = (
            source, position, segment)
    q_width = max(len(q[0]) for q in q_rows)
    num_flat = num_samples * tokens_per_sample
    q_index = torch.full((num_rows, q_width), num_flat, dtype=torch.long)
    q_segments = torch.full((num_rows, q_width), PAD_SEGMENT, dtype=torch.long)
    q_inverse = torch.empty(num_flat, dtype=torch.long)
    for r, (index, segment) in enumerate(q_rows):
        q_index[r, :len(index)], q_segments[r, :len(index)] = index, segment
        q_inverse[index] = r * q_width + torch.arange(len(index))
    tensors = dict(vl_source=vl_source, vl_positions=vl_positions, vl_segments=vl_segments, q_rows=q_index,
                   q_inverse=q_inverse, q_segments=q_segments)
    return GrootPlan(num_samples=num_samples, tokens_per_sample=tokens_per_sample,
                     **{k: v.to(device) for k, v in tensors.items()})


def to_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[M, ...] -> [R, T, ...] (zeros on padding)."""
    return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])[rows]


def from_rows(rowed: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """[R, T, ...] -> [M, ...] in flat order."""
    return rowed.flatten(0, 1)[inverse]
