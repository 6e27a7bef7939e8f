"""Packing variable-length multimodal samples into rows of a fixed token budget, instead of padding each one.

A VLA sample is image tokens + instruction tokens + state tokens + an action chunk; lengths vary with the number of
cameras and the instruction. Padding every sample to the longest wastes compute in proportion to the spread;
packing several samples into one row of `budget_tokens` and telling attention where each sample starts wastes only
the end of each row.

Algorithm: first-fit decreasing (FFD): samples sorted longest first (ties by index, so the result is deterministic),
each placed in the first row with room. It uses at most 11/9 * OPT + 6/9 rows, and when many samples fit in a row
(the usual case here) it is within a row or two of the lower bound ceil(total / budget), which `PackingStats`
reports next to the result. Best-fit decreasing has the same worst-case bound and no better typical case on such
inputs; exact bin packing is NP-hard and not worth a data-loader worker's time.

What attention backends get, per micro-batch of `num_rows` rows (shapes in brackets):
- segment_ids [num_rows, budget] int32: the sample's slot within its row (0, 1, ...), PAD_SEGMENT_ID for padding;
- position_ids [num_rows, budget] int64: restarting at 0 for every sample, 0 on padding;
- cu_seqlens [num_rows, max_segments + 1] int32: per row 0, l0, l0+l1, ..., right-filled with the row's last value
  (zero-length segments), so rows with fewer samples share one tensor; num_segments [num_rows] says how many count;
- prefix_lens [num_rows, max_segments] int32: each segment's prefix (images, instruction, state) length; the rest of
  the segment is its action part. `dense_attention_mask()` is the CPU reference of the prefix-LM mask;
- max_seqlen: the longest sample; `flat_cu_seqlens()` gives the boundaries for varlen kernels on the row-major
  flattened [num_rows * budget] stream.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate

from embodyhpc.errors import UserError

PAD_SEGMENT_ID = -1


class PackingError(UserError):
    """A sample does not fit the token budget (or there is nothing to pack)."""


@dataclass(frozen=True)
class SampleTokens:
    """Token counts of one sample, laid out in this order: images, instruction, state, then the action chunk.

    Images, instruction and state form the prefix (pi0.5 discretizes the state into the prompt); the prefix attends
    to itself bidirectionally, and the action tokens attend to the prefix and to each other.
    """

    num_image_tokens: int = 0
    num_text_tokens: int = 0
    num_state_tokens: int = 0
    num_action_tokens: int = 0

    def __post_init__(self) -> None:
        counts = (self.num_image_tokens, self.num_text_tokens, self.num_state_tokens, self.num_action_tokens)
        if min(counts) < 0 or sum(counts) == 0:
            raise ValueError(f"token counts must be >= 0 and not all 0, got {self}")

    @property
    def num_prefix_tokens(self) -> int:
        return self.num_image_tokens + self.num_text_tokens + self.num_state_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prefix_tokens + self.num_action_tokens


def _check_lengths(lengths: Sequence[int], budget_tokens: int) -> None:
    if budget_tokens < 1:
        raise PackingError(f"the token budget per row must be >= 1, got {budget_tokens}")
    if len(lengths) == 0:
        raise PackingError("no samples to pack")
    for index, length in enumerate(lengths):
        if length < 1:
            raise PackingError(f"sample {index} has {length} tokens; every sample needs at least 1")
        if length > budget_tokens:
            raise PackingError(f"sample {index} has {length} tokens, more than the budget of {budget_tokens} "
                               "tokens per row", fix=f"raise the token budget to at least {length} or shorten "
                               "the sample (fewer cameras or image tokens, a shorter instruction or action chunk)")


def first_fit_decreasing(lengths: Sequence[int], budget_tokens: int) -> list[list[int]]:
    """Rows of sample indices (ascending within a row), every sample exactly once, each row <= budget_tokens."""
    _check_lengths(lengths, budget_tokens)
    rows: list[list[int]] = []
    free_tokens: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        # A linear scan: micro-batches hold tens to hundreds of samples, where this beats a tree's bookkeeping.
        row = next((r for r, free in enumerate(free_tokens) if free >= lengths[index]), None)
        if row is None:
            rows.append([])
            free_tokens.append(budget_tokens)
            row = len(rows) - 1
        rows[row].append(index)
        free_tokens[row] -= lengths[index]
    return [sorted(row) for row in rows]


def next_fit(lengths: Sequence[int], budget_tokens: int) -> list[list[int]]:
    """The naive baseline: samples in arrival order, a new row whenever the next one does not fit."""
    _check_lengths(lengths, budget_tokens)
    rows: list[list[int]] = [[]]
    used_tokens = 0
    for index, length in enumerate(lengths):
        if used_tokens + length > budget_tokens:
            rows.append([])
            used_tokens = 0
        rows[-1].append(index)
        used_tokens += length
    return rows


@dataclass(frozen=True)
class PackingStats:
    """How much of a micro-batch is real tokens, packed and as pad-to-longest would have had it."""

    num_samples: int
    num_real_tokens: int
    num_rows: int
    budget_tokens: int
    longest_sample_tokens: int
    packing_efficiency: float  # real tokens / (num_rows * budget_tokens)
    padding_efficiency: float  # real tokens / (num_samples * longest sample): pad-to-longest, one sample per row
    min_num_rows: int  # ceil(real tokens / budget): no packing can use fewer rows


def packing_stats(lengths: Sequence[int], rows: Sequence[Sequence[int]], budget_tokens: int) -> PackingStats:
    num_real_tokens = sum(lengths)
    longest = max(lengths)
    return PackingStats(
        num_samples=len(lengths), num_real_tokens=num_real_tokens, num_rows=len(rows), budget_tokens=budget_tokens,
        longest_sample_tokens=longest, packing_efficiency=num_real_tokens / (len(rows) * budget_tokens),
        padding_efficiency=num_real_tokens / (len(lengths) * longest),
        min_num_rows=-(-num_real_tokens // budget_tokens))


@dataclass(frozen=True)
class PackedLayout:
    """Where each sample sits in the packed rows, in the forms attention backends consume (see module doc)."""

    rows: list[list[int]]  # sample indices per row, in segment order
    budget_tokens: int
    segment_ids: torch.Tensor  # [num_rows, budget] int32, PAD_SEGMENT_ID on padding
    position_ids: torch.Tensor  # [num_rows, budget] int64
    cu_seqlens: torch.Tensor  # [num_rows, max_segments + 1] int32
    num_segments: torch.Tensor  # [num_rows] int32
    prefix_lens: torch.Tensor  # [num_rows, max_segments] int32, 0 where a row has no such segment
    segment_sample_index: torch.Tensor  # [num_rows, max_segments] int64: input sample of each segment, -1 if none
    max_seqlen: int
    stats: PackingStats

    def flat_cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """(cu_seqlens int32 [num_segments_total + 1], max_seqlen) over the row-major flattened rows.

        Each row's padding tail is a segment of its own, so the boundaries cover all num_rows * budget tokens and
        real tokens never attend to padding; max_seqlen counts those padding segments too, as kernels require.
        """
        bounds = [0]
        for row in range(len(self.rows)):
            row_start = row * self.budget_tokens
            ends = self.cu_seqlens[row, 1: int(self.num_segments[row]) + 1].tolist()
            bounds += [row_start + end for end in ends]
            if bounds[-1] < row_start + self.budget_tokens:
                bounds.append(row_start + self.budget_tokens)
        cu = torch.tensor(bounds, dtype=torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())

    def dense_attention_mask(self) -> torch.Tensor:
        """[num_rows, budget, budget] bool, True where query (dim 1) may attend key (dim 2): the CPU reference.

        Same sample only; keys in the prefix are visible to all of the sample's tokens, keys in the action part
        only to its action tokens. A padding token sees only itself, so softmax stays finite; its output is unused.
        """
        segment = self.segment_ids.long()
        is_pad = segment == PAD_SEGMENT_ID
        # Per-token prefix length: gather by segment slot; padding reads an appended column of zeros.
        row_prefix = torch.cat([self.prefix_lens.long(), torch.zeros(len(self.rows), 1, dtype=torch.long)], dim=1)
        slot = torch.where(is_pad, row_prefix.shape[1] - 1, segment)
        in_prefix = self.position_ids < torch.gather(row_prefix, 1, slot)
        same_sample = (segment[:, :, None] == segment[:, None, :]) & ~is_pad[:, :, None]
        visible = in_prefix[:, None, :] | ~in_prefix[:, :, None]
        eye = torch.eye(self.budget_tokens, dtype=torch.bool)[None]
        return (same_sample & visible) | (eye & is_pad[:, :, None])


def pack_samples(samples: Sequence[SampleTokens], budget_tokens: int,
                 packer: Callable[[Sequence[int], int], list[list[int]]] = first_fit_decreasing) -> PackedLayout:
    """Pack samples into rows of budget_tokens; PackingError names any sample longer than the budget."""
    lengths = [s.num_tokens for s in samples]
    rows = packer(lengths, budget_tokens)
    max_segments = max(len(row) for row in rows)
    segment_ids = torch.full((len(rows), budget_tokens), PAD_SEGMENT_ID, dtype=torch.int32)
    position_ids = torch.zeros((len(rows), budget_tokens), dtype=torch.int64)
    cu_seqlens = torch.zeros((len(rows), max_segments + 1), dtype=torch.int32)
    prefix_lens = torch.zeros((len(rows), max_segments), dtype=torch.int32)
    segment_sample_index = torch.full((len(rows), max_segments), -1, dtype=torch.int64)
    for r, row in enumerate(rows):
        start = 0
        for slot, index in enumerate(row):
            end = start + lengths[index]
            segment_ids[r, start:end] = slot
            position_ids[r, start:end] = torch.arange(lengths[index])
            prefix_lens[r, slot] = samples[index].num_prefix_tokens
            segment_sample_index[r, slot] = index
            cu_seqlens[r, slot + 1] = end
            start = end
        cu_seqlens[r, len(row) + 1:] = start
    return PackedLayout(
        rows=rows, budget_tokens=budget_tokens, segment_ids=segment_ids, position_ids=position_ids,
        cu_seqlens=cu_seqlens, num_segments=torch.tensor([len(row) for row in rows], dtype=torch.int32),
        prefix_lens=prefix_lens, segment_sample_index=segment_sample_index, max_seqlen=max(lengths),
        stats=packing_stats(lengths, rows, budget_tokens))


class PackingCollator:
    """A DataLoader collate_fn: token tensors of many samples -> one micro-batch of packed rows.

    Each sample is a dict with its SampleTokens under `layout_key` and, under each key of `pad_values`, a tensor
    whose first dimension is the sample's num_tokens (ids, embeddings, loss masks...). Those become
    [num_rows, budget, ...] tensors, padded with the given value. Every other key is collated as usual, in the input
    order: segment_sample_index maps a segment back to it. `packing_stats` holds the PackingStats the trainer logs.
    A picklable object, so DataLoader workers can run it.
    """

    def __init__(self, budget_tokens: int, pad_values: Mapping[str, float | int | bool], *,
                 layout_key: str = "tokens_layout") -> None:
        if not pad_values:
            raise ValueError("pad_values must name at least one per-token key")
        self.budget_tokens = budget_tokens
        self.pad_values = dict(pad_values)
        self.layout_key = layout_key

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        layouts = [s[self.layout_key] for s in samples]
        for index, (sample, layout) in enumerate(zip(samples, layouts, strict=True)):
            for key in self.pad_values:
                if sample[key].shape[0] != layout.num_tokens:
                    raise PackingError(f"sample {index}: {key!r} has {sample[key].shape[0]} tokens but its "
                                       f"{self.layout_key} says {layout.num_tokens}")
        packed = pack_samples(layouts, self.budget_tokens)
        batch: dict[str, Any] = {}
        for key, pad_value in self.pad_values.items():
            first = samples[0][key]
            out = torch.full((len(packed.rows), self.budget_tokens, *first.shape[1:]), pad_value, dtype=first.dtype)
            for r, row in enumerate(packed.rows):
                start = 0
                for index in row:
                    tokens = samples[index][key]
                    out[r, start:start + tokens.shape[0]] = tokens
                    start += tokens.shape[0]
            batch[key] = out
        other_keys = [k for k in samples[0] if k not in self.pad_values and k != self.layout_key]
        if other_keys:
            batch.update(default_collate([{k: s[k] for k in other_keys} for s in samples]))
        batch.update(
            segment_ids=packed.segment_ids, position_ids=packed.position_ids, cu_seqlens=packed.cu_seqlens,
            num_segments=packed.num_segments, prefix_lens=packed.prefix_lens,
            segment_sample_index=packed.segment_sample_index, max_seqlen=packed.max_seqlen, packing_stats=packed.stats)
        return batch
