"""The pi0.5 micro-batch: what the data pipeline hands the model, and how it is built from samples.

Packing is described by `rows` (sample indices per row), the `rows` of embodyhpc.data.packing's PackedLayout:
the pipeline packs with `token_counts()` against its token budget, the model derives segment ids, rotary
positions and varlen boundaries for both of its streams from the rows (plan.py). Without rows every sample gets
a row of its own (a padded batch).

Tensors that only describe lengths (prompt_lengths, image_mask) stay on the host when the batch moves to a GPU:
the plan reads them as Python numbers, and keeping them there avoids a device sync per step. The others are pinned
by the DataLoader's pin-memory thread (`pin_memory()`, when the loader runs for a GPU) and copied without blocking.

uint8 images (data.image_dtype=uint8: the decoded bytes, at the camera's size) travel as they are, 4x fewer bytes to
pin and copy; `to()` turns them into the float [0, 1] images the model reads on the target device, after the copy:
divided by 255 in float32 and resized to `image_size` (the vision tower's input) the way Pi05Collate resizes float
images in the workers, so both give the model the same values (tests/train/test_uint8_step.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from embodyhpc.models.pinning import pin_batch
from embodyhpc.models.tokenizer import Tokenizer, encode_prompt

_HOST_FIELDS = ("prompt_lengths", "image_mask")


@dataclass(frozen=True)
class Pi05Sample:
    """One training or inference example as a dataset yields it."""

    images: torch.Tensor  # [C, 3, H, W] float in [0, 1] (or uint8 in [0, 255]), one image per camera
    instruction: str
    state: torch.Tensor  # [S] normalised to [-1, 1] (discretised into the prompt)
    actions: torch.Tensor | None = None  # [H, A] normalised action chunk; None at inference
    image_mask: torch.Tensor | None = None  # [C] bool: False where a camera is missing
    action_is_pad: torch.Tensor | None = None  # [H] bool: steps past the episode end (LeRobot's `action_is_pad`)
    num_action_dims: int | None = None  # the robot's real action dims; the rest of A is zero padding


@dataclass(frozen=True)
class Pi05Batch:
    images: torch.Tensor  # [N, C, 3, H, W] float in [0, 1]; uint8 in [0, 255] until `to()` (see the module doc)
    prompt_ids: torch.Tensor  # [N, L] int64: "Task: ..., State: ...;\nAction: " tokens, right-padded
    prompt_lengths: torch.Tensor  # [N] int64 (host)
    actions: torch.Tensor | None = None  # [N, H, A]; None at inference
    image_mask: torch.Tensor | None = None  # [N, C] bool (host); None = all cameras present
    action_is_pad: torch.Tensor | None = None  # [N, H] bool: excluded from the loss
    action_dim_mask: torch.Tensor | None = None  # [N, A] bool: True on the robot's real action dims
    state: torch.Tensor | None = None  # [N, S] raw state (the model reads it from the prompt); for logging
    rows: list[list[int]] | None = None  # packing: sample indices per row; None = one sample per row
    image_size: int | None = None  # uint8 images: the side `to()` resizes them to; None = as they are

    @property
    def num_samples(self) -> int:
        return self.images.shape[0]

    @property
    def num_cameras(self) -> int:
        return self.images.shape[1]

    def packing_rows(self) -> list[list[int]]:
        return self.rows if self.rows is not None else [[i] for i in range(self.num_samples)]

    def camera_valid(self) -> list[list[bool]]:
        if self.image_mask is None:
            return [[True] * self.num_cameras for _ in range(self.num_samples)]
        return self.image_mask.bool().tolist()

    def token_counts(self, num_patches: int, horizon: int) -> list[int]:
        """Tokens each sample occupies (images of present cameras + prompt + action chunk): the packer's input."""
        cameras = [sum(valid) for valid in self.camera_valid()]
        return [c * num_patches + int(n) + horizon for c, n in zip(cameras, self.prompt_lengths.tolist(), strict=True)]

    def with_rows(self, rows: list[list[int]] | None) -> Pi05Batch:
        return replace(self, rows=rows)

    def to(self, device: torch.device | str) -> Pi05Batch:
        """The batch on `device` (host fields stay); uint8 images become float [0, 1] there (see the module doc)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and f.name not in _HOST_FIELDS:
                value = value.to(device, non_blocking=True)
            moved[f.name] = value
        if moved["images"].dtype == torch.uint8:
            moved["images"] = float_images(moved["images"], self.image_size)
            moved["image_size"] = None
        return Pi05Batch(**moved)

    def pin_memory(self) -> Pi05Batch:
        """The batch with every tensor that `to()` moves in page-locked memory (models/pinning.py); host fields
        stay as they are."""
        return pin_batch(self, _HOST_FIELDS)

    def select(self, indices: list[int]) -> Pi05Batch:
        """The given samples as an unpacked batch of their own (tests, evaluation of single samples)."""
        index = torch.tensor(indices)
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            picked[f.name] = value[index.to(value.device)] if isinstance(value, torch.Tensor) else None
        picked["image_size"] = self.image_size
        return Pi05Batch(**picked)


def float_images(images: torch.Tensor, size: int | None) -> torch.Tensor:
    """uint8 [N, C, 3, H, W] -> float32 [N, C, 3, size, size] in [0, 1], on the images' device: the division a
    dataset's float items make (data/lerobot.py), then the resize Pi05Collate makes (bilinear, antialiased)."""
    images = images.to(torch.float32).div_(255)
    if size is None or images.shape[-2:] == (size, size):
        return images
    n, c = images.shape[:2]
    flat = torch.nn.functional.interpolate(images.flatten(0, 1), size=(size, size), mode="bilinear",
                                           align_corners=False, antialias=True)
    return flat.unflatten(0, (n, c))


def collate(samples: list[Pi05Sample], tokenizer: Tokenizer, *, max_prompt_tokens: int, num_state_bins: int = 256,
            rows: list[list[int]] | None = None, include_state: bool = True) -> Pi05Batch:
    """Tokenize prompts (instruction + discretised state) and stack samples; a DataLoader collate_fn body.

    include_state=False leaves the state out of the prompt (model.state_input=expert: the model reads batch.state).
    """
    if not samples:
        raise ValueError("no samples to collate")
    prompts = [encode_prompt(tokenizer, s.instruction, s.state if include_state else None, max_tokens=max_prompt_tokens,
                             num_bins=num_state_bins) for s in samples]
    lengths = torch.tensor([len(p) for p in prompts])
    prompt_ids = torch.full((len(samples), int(lengths.max())), tokenizer.pad_id, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        prompt_ids[i, :len(prompt)] = torch.tensor(prompt)
    has_actions = samples[0].actions is not None
    if any((s.actions is not None) != has_actions for s in samples):
        raise ValueError("either every sample has actions (training) or none does (inference)")
    actions = torch.stack([s.actions for s in samples]) if has_actions else None
    image_mask = None
    if any(s.image_mask is not None for s in samples):
        image_mask = torch.stack([s.image_mask if s.image_mask is not None
                                  else torch.ones(s.images.shape[0], dtype=torch.bool) for s in samples]).bool()
    action_is_pad = None
    if has_actions and any(s.action_is_pad is not None for s in samples):
        action_is_pad = torch.stack([s.action_is_pad if s.action_is_pad is not None
                                     else torch.zeros(s.actions.shape[0], dtype=torch.bool) for s in samples])
    action_dim_mask = None
    if has_actions and any(s.num_action_dims is not None for s in samples):
        dims = torch.arange(actions.shape[-1])
        action_dim_mask = torch.stack([dims < (s.num_action_dims or actions.shape[-1]) for s in samples])
    return Pi05Batch(images=torch.stack([s.images for s in samples]), prompt_ids=prompt_ids, prompt_lengths=lengths,
                     actions=actions, image_mask=image_mask, action_is_pad=action_is_pad,
                     action_dim_mask=action_dim_mask, state=torch.stack([s.state for s in samples]), rows=rows)
