"""Where every token of a (packed) batch goes: the two streams of pi0.5, flat for the per-token layers and in rows
for attention.

The model runs two streams of different widths and weights: the prefix stream (image patches, then prompt tokens,
per sample) and the action stream (the noisy action chunk, per sample). Everything but attention works token by
token (norms, projections, MLPs), so each stream is kept FLAT: all its real tokens of the micro-batch one after
another, [1, tokens, width], padded only to a multiple of TOKEN_ALIGNMENT. No token is computed for row padding
in these layers, whatever the row lengths of the two streams (a row with many short samples has a long action
stream and a short prefix stream, a row with one long sample the reverse; padding each stream to its own longest
row wasted ~8 points more than the packer's own waste).

Attention works in rows (the packer's rows, `rows`): a row's tokens are gathered from the flat streams into one
joint sequence, its samples' prefix tokens then their action tokens, padded to the longest row, so attention sees
exactly the packer's padding. The samples of a row have their slot numbers (segment ids) across both streams, so
attention (attention.py) keeps them apart; rotary positions restart at 0 for every sample: images (valid cameras
only), then prompt, then actions. Inference uses per-stream rows as well: the prefix alone (filling the cache) and
the action stream's queries over the joint keys (an Euler step over the cached prefix).

Index conventions (every gather appends one zero row to what it gathers from, so "one past the end" is padding):
- prefix flat index p in [0, Np), action flat index a in [0, Na); joint flat = cat(prefix flat, action flat).
- *_rows [R, T]: flat index of each row token (rows of the joint / prefix / action stream); *_inverse [N]: index in
  the row-major R*T of each flat token (alignment padding -> R*T, the appended zero row).
The plan is built from the batch's lengths on the host (one small Python loop over samples).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from embodyhpc.models.attention import PAD_SEGMENT, AttentionLayout
from embodyhpc.models.shapes import TOKEN_ALIGNMENT  # flat streams are padded to it: at most 15 tokens lost


@dataclass(frozen=True, eq=False)
class TokenPlan:
    num_samples: int
    # flat streams (the per-token layers)
    prefix_source: torch.Tensor  # [1, Np] int64 into cat(image tokens [N*C*P], prompt tokens [N*L], a zero row)
    prefix_positions: torch.Tensor  # [1, Np] int64
    suffix_source: torch.Tensor  # [1, Na] int64 into cat(action tokens [N*H], a zero row)
    suffix_positions: torch.Tensor  # [1, Na]
    suffix_sample: torch.Tensor  # [1, Na] sample of each action token; N on padding
    action_slots: torch.Tensor  # [N*H] index into the flat action stream of each sample's action tokens, sample-major
    # rows (attention)
    joint_rows: torch.Tensor  # [R, Tj] into cat(prefix flat, action flat, zero)
    joint_inverse: torch.Tensor  # [Np + Na] into R*Tj (+ zero)
    joint_segments: torch.Tensor  # [R, Tj] slot in the row, PAD_SEGMENT on padding
    joint_is_prefix: torch.Tensor  # [R, Tj] bool
    prefix_rows: torch.Tensor  # [R, Tp] into cat(prefix flat, zero)
    prefix_inverse: torch.Tensor  # [Np] into R*Tp (+ zero)
    prefix_segments: torch.Tensor  # [R, Tp]
    suffix_rows: torch.Tensor  # [R, Ta] into cat(action flat, zero)
    suffix_inverse: torch.Tensor  # [Na] into R*Ta (+ zero)
    suffix_segments: torch.Tensor  # [R, Ta]

    @property
    def num_prefix_tokens(self) -> int:
        """Np: tokens of the flat prefix stream (alignment padding included)."""
        return self.prefix_source.shape[1]

    @cached_property
    def joint_layout(self) -> AttentionLayout:
        """Training: queries = keys = each row's prefix tokens then its action tokens."""
        return AttentionLayout.self_attention(self.joint_segments, self.joint_is_prefix)

    @cached_property
    def prefix_layout(self) -> AttentionLayout:
        """The prefix alone (filling the inference cache): prefix tokens never see actions anyway."""
        return AttentionLayout.self_attention(self.prefix_segments, torch.ones_like(self.prefix_segments, dtype=bool))

    @cached_property
    def suffix_layout(self) -> AttentionLayout:
        """Queries = the action stream's rows; keys = the joint rows (prefix fresh or cached, then actions)."""
        joint = self.joint_layout
        q_is_prefix = self.suffix_segments == PAD_SEGMENT  # padding counts as prefix of the padding segment
        return AttentionLayout(self.suffix_segments, q_is_prefix, joint.k_segment_ids, joint.k_is_prefix)


def to_rows(flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[1, N, ...] flat tokens -> [R, T, ...] rows (zeros on padding)."""
    flat = flat[0]
    return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])[rows]


def from_rows(rowed: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """[R, T, ...] rows -> [1, N, ...] flat tokens (zeros for the flat stream's alignment padding)."""
    flat = rowed.flatten(0, 1)
    return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])[inverse][None]


def build_token_plan(*, rows: list[list[int]], num_cameras: int, num_patches: int, camera_valid: list[list[bool]],
                     prompt_lengths: list[int], max_prompt_len: int, horizon: int,
                     device: torch.device | str = "cpu") -> TokenPlan:
    """Gather indices for samples placed in `rows` (sample indices per row, every sample exactly once)."""
    num_samples = len(prompt_lengths)
    placed = sorted(i for row in rows for i in row)
    if placed != list(range(num_samples)):
        raise ValueError(f"rows must place each of the {num_samples} samples exactly once, got {rows}")
    prompt_base = num_samples * num_cameras * num_patches
    prefix_zero, suffix_zero = prompt_base + num_samples * max_prompt_len, num_samples * horizon
    prefix = {"source": [], "position": []}
    suffix = {"source": [], "position": [], "sample": []}
    row_prefix, row_suffix = [], []  # per row: (flat range, segment ids)
    action_start = [0] * num_samples
    num_prefix = num_suffix = 0
    for row in rows:
        p_start, a_start, p_seg, a_seg = num_prefix, num_suffix, [], []
        for slot, s in enumerate(row):
            sources = [(s * num_cameras + c) * num_patches + torch.arange(num_patches)
                       for c in range(num_cameras) if camera_valid[s][c]]  # missing cameras: no tokens at all
            sources.append(prompt_base + s * max_prompt_len + torch.arange(prompt_lengths[s]))
            source = torch.cat(sources)
            prefix["source"].append(source)
            prefix["position"].append(torch.arange(len(source)))
            p_seg.append(torch.full((len(source),), slot))
            suffix["source"].append(s * horizon + torch.arange(horizon))
            suffix["position"].append(len(source) + torch.arange(horizon))
            suffix["sample"].append(torch.full((horizon,), s))
            a_seg.append(torch.full((horizon,), slot))
            action_start[s] = num_suffix
            num_prefix += len(source)
            num_suffix += horizon
        row_prefix.append((torch.arange(p_start, num_prefix), torch.cat(p_seg)))
        row_suffix.append((torch.arange(a_start, num_suffix), torch.cat(a_seg)))
    flat_p, flat_a = _aligned(num_prefix), _aligned(num_suffix)
    prefix_source = _padded(torch.cat(prefix["source"]), flat_p, prefix_zero)
    prefix_positions = _padded(torch.cat(prefix["position"]), flat_p, 0)
    suffix_source = _padded(torch.cat(suffix["source"]), flat_a, suffix_zero)
    suffix_positions = _padded(torch.cat(suffix["position"]), flat_a, 0)
    suffix_sample = _padded(torch.cat(suffix["sample"]), flat_a, num_samples)
    action_slots = torch.cat([start + torch.arange(horizon) for start in action_start])

    prefix_rows, prefix_segments, prefix_inverse = _rows(row_prefix, flat_p)
    suffix_rows, suffix_segments, suffix_inverse = _rows(row_suffix, flat_a)
    joint = [(torch.cat([p_index, flat_p + a_index]), torch.cat([p_seg, a_seg]))
             for (p_index, p_seg), (a_index, a_seg) in zip(row_prefix, row_suffix, strict=True)]
    # A padding query of the action rows (suffix layout: keys = joint rows) must see a padding key of its row: a row
    # whose joint sequence is the longest yet whose action stream is not gets one padding slot more.
    longest, most_actions = max(len(j) for j, _ in joint), max(len(a) for a, _ in row_suffix)
    extra = any(len(j) == longest and len(a) < most_actions for (j, _), (a, _) in zip(joint, row_suffix, strict=True))
    joint_rows, joint_segments, joint_inverse = _rows(joint, flat_p + flat_a, width=longest + int(extra))
    joint_is_prefix = joint_rows < num_prefix  # real prefix tokens; padding gets flagged by the layout
    tensors = dict(prefix_source=prefix_source, prefix_positions=prefix_positions, suffix_source=suffix_source,
                   suffix_positions=suffix_positions, suffix_sample=suffix_sample, action_slots=action_slots,
                   joint_rows=joint_rows, joint_inverse=joint_inverse, joint_segments=joint_segments,
                   joint_is_prefix=joint_is_prefix, prefix_rows=prefix_rows, prefix_inverse=prefix_inverse,
                   prefix_segments=prefix_segments, suffix_rows=suffix_rows, suffix_inverse=suffix_inverse,
                   suffix_segments=suffix_segments)
    flat = {"prefix_source", "prefix_positions", "suffix_source", "suffix_positions", "suffix_sample"}
    return TokenPlan(num_samples=num_samples,
                     **{k: (v[None] if k in flat else v).to(device) for k, v in tensors.items()})


def _aligned(n: int) -> int:
    return max(-(-n // TOKEN_ALIGNMENT) * TOKEN_ALIGNMENT, TOKEN_ALIGNMENT)


def _padded(values: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    return torch.cat([values, torch.full((length - len(values),), pad, dtype=values.dtype)])


def _rows(rows: list[tuple[torch.Tensor, torch.Tensor]], num_flat: int,
          width: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(flat index [R, T] padded with num_flat, segments [R, T] padded with PAD_SEGMENT, inverse [num_flat]);
    T = the longest row unless given."""
    width = width or max(len(index) for index, _ in rows)
    index = torch.full((len(rows), width), num_flat, dtype=torch.long)
    segments = torch.full((len(rows), width), PAD_SEGMENT, dtype=torch.long)
    inverse = torch.full((num_flat,), len(rows) * width, dtype=torch.long)
    for r, (flat, seg) in enumerate(rows):
        index[r, :len(flat)] = flat
        segments[r, :len(flat)] = seg
        inverse[flat] = r * width + torch.arange(len(flat))
    return index, segments, inverse
