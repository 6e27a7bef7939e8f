"""Where every token of a (packed) batch goes: the two streams of pi0.5 laid out in rows.

The model runs two streams of different widths: the prefix stream (image patches, then prompt tokens, per sample)
and the action stream (the noisy action chunk, per sample). With packing, a row holds several samples; each
stream of a row is its samples' tokens one after another, padded to the longest row. The samples of a row share
its slot numbers (segment ids) across both streams, so attention (attention.py) keeps them apart, and rotary
positions restart at 0 for every sample: images (valid cameras only), then prompt, then actions.

The plan holds gather indices built from the batch's lengths on the host (one small Python loop over samples),
so the model turns per-sample tensors into packed rows with one indexing op per stream and back again.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from embodyhpc.models.attention import PAD_SEGMENT, AttentionLayout

# Stream widths are padded to a multiple of this: fp8 GEMMs (transformer-engine) need the token dimension of a
# Linear's input divisible by 8 or 16; a row loses at most 15 padding tokens to it.
TOKEN_ALIGNMENT = 16


@dataclass(frozen=True, eq=False)
class TokenPlan:
    num_samples: int
    prefix_source: torch.Tensor  # [R, Tp] int64 into cat(image tokens [N*C*P], prompt tokens [N*L], a zero row)
    prefix_segments: torch.Tensor  # [R, Tp] int64, PAD_SEGMENT on padding
    prefix_positions: torch.Tensor  # [R, Tp] int64
    suffix_source: torch.Tensor  # [R, Ta] int64 into cat(action tokens [N*H], a zero row)
    suffix_segments: torch.Tensor  # [R, Ta]
    suffix_positions: torch.Tensor  # [R, Ta]
    suffix_sample: torch.Tensor  # [R, Ta] sample of each action token; N on padding
    action_slots: torch.Tensor  # [N*H] flat index into R*Ta of each sample's action tokens, sample-major

    @cached_property
    def joint_layout(self) -> AttentionLayout:
        """Training: queries = keys = prefix stream then action stream."""
        return AttentionLayout.self_attention(torch.cat([self.prefix_segments, self.suffix_segments], 1),
                                              torch.cat([self._prefix_flags, self._suffix_flags], 1))

    @cached_property
    def prefix_layout(self) -> AttentionLayout:
        """The prefix alone (filling the inference cache): prefix tokens never see actions anyway."""
        return AttentionLayout.self_attention(self.prefix_segments, self._prefix_flags)

    @cached_property
    def suffix_layout(self) -> AttentionLayout:
        """Queries = the action stream; keys = prefix stream (fresh or cached) then action stream."""
        joint = self.joint_layout
        return AttentionLayout(self.suffix_segments, self._suffix_flags, joint.k_segment_ids, joint.k_is_prefix)

    @cached_property
    def _prefix_flags(self) -> torch.Tensor:
        return torch.ones_like(self.prefix_segments, dtype=torch.bool)

    @cached_property
    def _suffix_flags(self) -> torch.Tensor:
        return self.suffix_segments == PAD_SEGMENT  # padding counts as prefix of the padding segment


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
    prefix_rows, suffix_rows = [], []
    action_offset = [0] * num_samples  # (row, start) of each sample's action tokens
    for r, row in enumerate(rows):
        prefix: dict[str, list[torch.Tensor]] = {"source": [], "segment": [], "position": []}
        suffix: dict[str, list[torch.Tensor]] = {"source": [], "segment": [], "position": [], "sample": []}
        suffix_len = 0
        for slot, s in enumerate(row):
            sources = [(s * num_cameras + c) * num_patches + torch.arange(num_patches)
                       for c in range(num_cameras) if camera_valid[s][c]]  # missing cameras: no tokens at all
            sources.append(prompt_base + s * max_prompt_len + torch.arange(prompt_lengths[s]))
            source = torch.cat(sources)
            prefix["source"].append(source)
            prefix["segment"].append(torch.full_like(source, slot))
            prefix["position"].append(torch.arange(len(source)))
            suffix["source"].append(s * horizon + torch.arange(horizon))
            suffix["segment"].append(torch.full((horizon,), slot))
            suffix["position"].append(len(source) + torch.arange(horizon))
            suffix["sample"].append(torch.full((horizon,), s))
            action_offset[s] = (r, suffix_len)
            suffix_len += horizon
        prefix_rows.append({k: torch.cat(v) for k, v in prefix.items()})
        suffix_rows.append({k: torch.cat(v) for k, v in suffix.items()})
    prefix_pad = {"source": prefix_zero, "segment": PAD_SEGMENT, "position": 0}
    suffix_pad = {"source": suffix_zero, "segment": PAD_SEGMENT, "position": 0, "sample": num_samples}
    prefix_t = _pad_rows(prefix_rows, prefix_pad)
    suffix_t = _pad_rows(suffix_rows, suffix_pad)
    suffix_width = suffix_t["source"].shape[1]
    action_slots = torch.cat([r * suffix_width + start + torch.arange(horizon) for r, start in action_offset])
    return TokenPlan(
        num_samples=num_samples, prefix_source=prefix_t["source"].to(device),
        prefix_segments=prefix_t["segment"].to(device), prefix_positions=prefix_t["position"].to(device),
        suffix_source=suffix_t["source"].to(device), suffix_segments=suffix_t["segment"].to(device),
        suffix_positions=suffix_t["position"].to(device), suffix_sample=suffix_t["sample"].to(device),
        action_slots=action_slots.to(device))


def _pad_rows(rows: list[dict[str, torch.Tensor]], pad: dict[str, int]) -> dict[str, torch.Tensor]:
    width = -(-max(len(row["source"]) for row in rows) // TOKEN_ALIGNMENT) * TOKEN_ALIGNMENT
    out = {}
    for key, value in pad.items():
        out[key] = torch.full((len(rows), width), value, dtype=torch.long)
        for r, row in enumerate(rows):
            out[key][r, :len(row[key])] = row[key]
    return out
