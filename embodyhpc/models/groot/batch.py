"""The GR00T micro-batch: images, instruction tokens, the state vector, the action chunk and the embodiment id.

Packing is described by `rows` (sample indices per row, from embodyhpc.data.packing over `token_counts()`): only the
VLM tokens (images + instruction) are packed; the action side has the same token count for every sample. Without
rows every sample gets a row of its own. `text_lengths` stays on the host (the plan reads it as Python numbers);
the other tensors are pinned by the DataLoader's pin-memory thread (`pin_memory()`, when the loader runs for a GPU)
and copied without blocking.

uint8 images (data.image_dtype=uint8: the decoded bytes, at the camera's size) travel as they are; `to()` turns them
into float [0, 1] on the target device after the copy: divided by 255 in float32 and resized to `image_size` the way
GrootCollate resizes float images in the workers, so the model sees the same values either way.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from embodyhpc.models.pinning import pin_batch

_HOST_FIELDS = ("text_lengths",)


@dataclass(frozen=True)
class GrootSample:
    images: torch.Tensor  # [C, 3, H, W] float in [0, 1]
    text_ids: list[int]  # the instruction's tokens
    state: torch.Tensor  # [S] normalised, zero-padded to the model's max_state_dim
    actions: torch.Tensor | None = None  # [H, A]
    action_is_pad: torch.Tensor | None = None  # [H] bool
    num_action_dims: int | None = None
    embodiment: int | None = None  # its dataset's embodiment id (data.datasets[i].embodiment); None: the collate's


@dataclass(frozen=True)
class GrootBatch:
    images: torch.Tensor  # [N, C, 3, H, W] float in [0, 1]; uint8 in [0, 255] until `to()` (see the module doc)
    text_ids: torch.Tensor  # [N, L] right-padded with 0
    text_lengths: torch.Tensor  # [N] int64 (host)
    state: torch.Tensor  # [N, max_state_dim]
    embodiment: torch.Tensor  # [N] int64: which category MLP weights serve the sample
    actions: torch.Tensor | None = None  # [N, H, A]
    action_is_pad: torch.Tensor | None = None  # [N, H] bool
    action_dim_mask: torch.Tensor | None = None  # [N, A] bool
    rows: list[list[int]] | None = None
    image_size: int | None = None  # uint8 images: the side `to()` resizes them to; None = as they are

    @property
    def num_samples(self) -> int:
        return self.images.shape[0]

    def packing_rows(self) -> list[list[int]]:
        return self.rows if self.rows is not None else [[i] for i in range(self.num_samples)]

    def token_counts(self, num_patches: int) -> list[int]:
        """VLM tokens per sample (every camera's patches + the instruction): what the packer packs."""
        images = self.images.shape[1] * num_patches
        return [images + int(n) for n in self.text_lengths.tolist()]

    def with_rows(self, rows: list[list[int]] | None) -> GrootBatch:
        return replace(self, rows=rows)

    def to(self, device: torch.device | str) -> GrootBatch:
        """The batch on `device` (host fields stay); uint8 images become float [0, 1] there (see the module doc)."""
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in moved.items():
            if isinstance(value, torch.Tensor) and name not in _HOST_FIELDS:
                moved[name] = value.to(device, non_blocking=True)
        if moved["images"].dtype == torch.uint8:
            moved["images"] = float_images(moved["images"], self.image_size)
            moved["image_size"] = None
        return GrootBatch(**moved)

    def pin_memory(self) -> GrootBatch:
        """The batch with every tensor that `to()` moves in page-locked memory (models/pinning.py); host fields
        stay as they are."""
        return pin_batch(self, _HOST_FIELDS)

    def select(self, indices: list[int]) -> GrootBatch:
        """The given samples as an unpacked batch of their own (tests)."""
        index = torch.tensor(indices)
        picked = {f.name: getattr(self, f.name) for f in fields(self)}
        for name, value in picked.items():
            picked[name] = value[index.to(value.device)] if isinstance(value, torch.Tensor) else None
        picked["image_size"] = self.image_size
        return GrootBatch(**picked)


def float_images(images: torch.Tensor, size: int | None) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> float32 [..., 3, size, size] in [0, 1], on the images' device: the division a
    dataset's float items make (data/lerobot.py), then the resize GrootCollate makes (bilinear, antialiased)."""
    images = images.to(torch.float32).div_(255)
    if size is None or images.shape[-2:] == (size, size):
        return images
    lead = images.shape[:-3]
    flat = torch.nn.functional.interpolate(images.reshape(-1, *images.shape[-3:]), size=(size, size),
                                           mode="bilinear", align_corners=False, antialias=True)
    return flat.reshape(*lead, *flat.shape[1:])


def collate(samples: list[GrootSample], *, embodiment_id: int) -> GrootBatch:
    if not samples:
        raise ValueError("no samples to collate")
    lengths = torch.tensor([len(s.text_ids) for s in samples])
    text_ids = torch.zeros((len(samples), max(int(lengths.max()), 1)), dtype=torch.long)
    for i, sample in enumerate(samples):
        text_ids[i, :len(sample.text_ids)] = torch.tensor(sample.text_ids, dtype=torch.long)
    has_actions = samples[0].actions is not None
    if any((s.actions is not None) != has_actions for s in samples):
        raise ValueError("either every sample has actions (training) or none does (inference)")
    actions = action_is_pad = action_dim_mask = None
    if has_actions:
        actions = torch.stack([s.actions for s in samples])
        if any(s.action_is_pad is not None for s in samples):
            action_is_pad = torch.stack([s.action_is_pad if s.action_is_pad is not None
                                         else torch.zeros(s.actions.shape[0], dtype=torch.bool) for s in samples])
        if any(s.num_action_dims is not None for s in samples):
            dims = torch.arange(actions.shape[-1])
            action_dim_mask = torch.stack([dims < (s.num_action_dims or actions.shape[-1]) for s in samples])
    return GrootBatch(images=torch.stack([s.images for s in samples]), text_ids=text_ids, text_lengths=lengths,
                      state=torch.stack([s.state for s in samples]).float(),
                      embodiment=torch.tensor([embodiment_id if s.embodiment is None else s.embodiment
                                               for s in samples], dtype=torch.long), actions=actions,
                      action_is_pad=action_is_pad, action_dim_mask=action_dim_mask)
