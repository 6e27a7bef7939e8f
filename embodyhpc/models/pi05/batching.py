"""LeRobot-style dataset items -> pi0.5 samples and batches (the spec's collate and token counts): the only place
that knows both vocabularies.

An item is what `embodyhpc.data.open_dataset(root, delta_timestamps={"action": [...]})[i]` returns:
    observation.images.<camera>  [3, H, W] float in [0, 1]   (or [T, 3, H, W] with delta_timestamps on images)
    observation.state            [S]                         (or [T, S])
    action                       [H, A]  the chunk asked for by delta_timestamps["action"]
    action_is_pad                [H] bool: chunk steps past the episode end
    task                         str: the language instruction

Choices made here, and why:
- uint8 images (data.image_dtype=uint8) stay uint8 at the camera's size through the workers: the batch carries the
  tower's input size and its `to()` converts and resizes on the training device (batch.py float_images), with the
  same operations as the float path below, so the model sees the same values either way.
- Cameras are stacked in sorted key order, so every sample of a dataset lists them alike and the model's camera
  slots keep a fixed meaning.
- Pi05Collate resizes images to the vision tower's input size, in float32, with the tower's own method (bilinear,
  antialiased), so the model's resize becomes a no-op. Two reasons: it runs in the DataLoader workers instead of
  the training step and moves fewer bytes to the GPU; and under bf16 mixed precision the model would resize in
  bf16, which PyTorch's CPU kernel does not implement (antialiased bilinear raises NotImplementedError for
  BFloat16 as of torch 2.13), so bf16 training on CPU fails without it.
- With a time axis on images or state (history frames), only the newest frame is used: pi0.5 conditions on the
  current observation.
- Action dims are zero-padded up to model.action_dim and `num_action_dims` tells the loss which are real (pi0.5
  trains one action width across robots). A dataset with more dims than model.action_dim is trimmed to the first
  model.action_dim, with a warning once per process: the alternative, refusing, would block datasets that append
  unused dims, but a trimmed real dim is never learned, so the warning names the fix.
- The chunk length must equal model.action_horizon: a silent trim or pad there would change what the policy
  predicts, so it is refused with the delta_timestamps that fix it.
- The state is model.state_key, normalised with the dataset's statistics when model.state_norm asks for it
  (embodyhpc.data.normalize; the loop saves the statistics next to the exported weights for evaluation). With
  model.state_input=prompt it is discretised into the prompt (clamped to [-1, 1]); with expert the model reads the
  vector. Actions are used as stored (MetaWorld's are already in [-1, 1]); action normalisation is not built yet.
- A mixture's sample (data.datasets: the item has `dataset_index`) is normalised with its own dataset's statistics
  and its state zero-padded to model.state_dim (openpi pads every robot's state to one width), so robots with
  different state and action widths share micro-batches; the padded action dims are masked out of the loss.
- model.packing (the default) packs each micro-batch's samples into rows of model.max_token_len tokens with
  first-fit decreasing (embodyhpc.data.packing) and hands the rows to the model (Pi05Batch.rows), which derives
  segment ids, positions and varlen boundaries from them; every sample fits a row by construction (the prompt
  budget is what max_token_len leaves after images and actions). packing: false gives each sample its own row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from embodyhpc.config.schema import ModelConfig
from embodyhpc.data.mixture import DATASET_INDEX_KEY, normalizer_for
from embodyhpc.data.packing import first_fit_decreasing
from embodyhpc.errors import ConfigError
from embodyhpc.models.pi05.batch import Pi05Batch, Pi05Sample, collate
from embodyhpc.models.pi05.build import max_prompt_tokens
from embodyhpc.models.pi05.shapes import shape_for

log = logging.getLogger(__name__)

IMAGE_PREFIX = "observation.images."
STATE_KEY = "observation.state"
ACTION_KEY = "action"
ACTION_PAD_KEY = "action_is_pad"
TASK_KEY = "task"

_warned_trim = False


def camera_keys(item: Mapping[str, Any]) -> list[str]:
    """The item's camera keys in the fixed (sorted) order they are stacked in."""
    # not `<camera>_is_pad`: the pad mask delta_timestamps on a camera adds (history frames)
    return sorted(key for key in item if key.startswith(IMAGE_PREFIX) and not key.endswith("_is_pad"))


def to_pi05_sample(item: Mapping[str, Any], model_cfg: ModelConfig, normalizer: Any = None) -> Pi05Sample:
    """One LeRobot-style item as a training Pi05Sample for the policy described by `model_cfg`.

    The state is item[model_cfg.state_key], normalised by `normalizer` (embodyhpc.data.normalize) when given.
    """
    cameras = camera_keys(item)
    if not cameras:
        raise ValueError(f"the item has no {IMAGE_PREFIX}* keys (keys: {', '.join(sorted(item))}): pi0.5 needs at "
                         "least one camera")
    images = torch.stack([_newest(torch.as_tensor(item[key]), image_ndim=3) for key in cameras])  # [C, 3, H, W]
    key = getattr(model_cfg, "state_key", STATE_KEY)
    if key not in item:
        raise ConfigError(f"the dataset has no {key!r} (keys: {', '.join(sorted(item))})", key="model.state_key",
                          fix="name a vector feature of the dataset")
    state = _newest(torch.as_tensor(item[key]), image_ndim=1).float()  # [S]
    if normalizer is not None:
        state = normalizer_for(normalizer, item)(state)  # a mixture's sample: its own dataset's statistics
    if DATASET_INDEX_KEY in item:  # a mixture's robots differ in state width: zero-pad to the model's (as openpi)
        state = _pad_state(torch.as_tensor(state), model_cfg, key)
    actions = torch.as_tensor(item[ACTION_KEY]).float()
    horizon = model_cfg.action_horizon
    if actions.ndim != 2 or actions.shape[0] != horizon:
        raise ConfigError(
            f"the dataset's action chunk has shape {tuple(actions.shape)}, the model predicts {horizon} steps "
            f"(model.action_horizon={horizon})", key="data.delta_timestamps", related=("model.action_horizon",),
            fix=f"set data.delta_timestamps.action to {horizon} offsets, e.g. [i / fps for i in range({horizon})]")
    actions, num_dims = _fit_action_dims(actions, model_cfg.action_dim)
    is_pad = item.get(ACTION_PAD_KEY)
    images = images if images.dtype == torch.uint8 else images.float()  # uint8: converted in Pi05Batch.to()
    return Pi05Sample(images=images, instruction=str(item.get(TASK_KEY, "")), state=state, actions=actions,
                      action_is_pad=None if is_pad is None else torch.as_tensor(is_pad).bool(),
                      num_action_dims=num_dims)


def _pad_state(state: torch.Tensor, model_cfg: ModelConfig, key: str) -> torch.Tensor:
    """A mixture sample's state zero-padded to model.state_dim, so that samples of robots with different state
    widths stack (the padded dims are 0 after normalisation, in the prompt's bins or the projection's input)."""
    width = int(getattr(model_cfg, "state_dim", 0) or 0)
    if state.shape[-1] > width:
        raise ConfigError(f"a mixture's state {key!r} has {state.shape[-1]} dims, more than model.state_dim={width} "
                          "that every dataset's state is padded to", key="model.state_dim",
                          fix=f"set model.state_dim={state.shape[-1]}")
    return torch.nn.functional.pad(state.float(), (0, width - state.shape[-1]))


def _newest(tensor: torch.Tensor, *, image_ndim: int) -> torch.Tensor:
    """Drop a leading history axis (delta_timestamps on an observation), keeping the newest frame."""
    if tensor.ndim == image_ndim + 1:
        return tensor[-1]
    if tensor.ndim != image_ndim:
        raise ValueError(f"expected {image_ndim} dims (or {image_ndim + 1} with a time axis), "
                         f"got {tuple(tensor.shape)}")
    return tensor


def _fit_action_dims(actions: torch.Tensor, action_dim: int) -> tuple[torch.Tensor, int]:
    """[H, A] -> ([H, action_dim], real dims): zero-pad, or trim with a warning (see the module doc)."""
    global _warned_trim
    num_dims = actions.shape[1]
    if num_dims > action_dim:
        if not _warned_trim:
            log.warning("the dataset has %d action dims, model.action_dim=%d: dims %d.. are dropped and never "
                        "learned (set model.action_dim=%d to keep them)", num_dims, action_dim, action_dim, num_dims)
            _warned_trim = True
        return actions[:, :action_dim].contiguous(), action_dim
    if num_dims < action_dim:
        actions = torch.nn.functional.pad(actions, (0, action_dim - num_dims))
    return actions, num_dims


class Pi05Collate:
    """DataLoader collate_fn: LeRobot-style items -> one padded Pi05Batch (no packing in this version).

    A class rather than a closure so that DataLoader workers can pickle it. The prompt budget depends on the
    number of cameras, read from the first batch (the same for every item of a dataset).
    """

    def __init__(self, model_cfg: ModelConfig, tokenizer: Any, normalizer: Any = None) -> None:
        self.model_cfg = model_cfg
        self.tokenizer = tokenizer
        self.normalizer = normalizer
        self._prompt_budget: int | None = None
        self._image_size = shape_for(model_cfg.size).vision.image_size

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> Pi05Batch:
        samples = [to_pi05_sample(item, self.model_cfg, self.normalizer) for item in items]
        if self._prompt_budget is None:
            self._prompt_budget = max_prompt_tokens(self.model_cfg, samples[0].images.shape[0])
        batch = collate(samples, self.tokenizer, max_prompt_tokens=self._prompt_budget,
                        include_state=getattr(self.model_cfg, "state_input", "prompt") == "prompt")
        if self.model_cfg.packing:  # rows of model.max_token_len tokens, first-fit decreasing (data/packing.py)
            lengths = batch.token_counts(shape_for(self.model_cfg.size).vision.num_patches,
                                         self.model_cfg.action_horizon)
            batch = batch.with_rows(first_fit_decreasing(lengths, self.model_cfg.max_token_len))
        if batch.images.dtype == torch.uint8:  # resized on the training device, after the copy (Pi05Batch.to)
            return replace(batch, image_size=self._image_size)
        return replace(batch, images=resize_images(batch.images, self._image_size))


def resize_images(images: torch.Tensor, size: int) -> torch.Tensor:
    """[N, C, 3, H, W] -> [N, C, 3, size, size] in float32, the way the pi0.5 vision tower resizes."""
    if images.shape[-2:] == (size, size):
        return images
    n, c = images.shape[:2]
    flat = torch.nn.functional.interpolate(images.flatten(0, 1).float(), size=(size, size), mode="bilinear",
                                           align_corners=False, antialias=True)
    return flat.unflatten(0, (n, c))


def batch_tokens(batch: Pi05Batch, model_cfg: ModelConfig) -> int:
    """Tokens the batch puts through the transformer (image patches of present cameras + prompt + action chunk):
    the count behind the tokens_per_s metric, padding excluded."""
    return sum(batch.token_counts(shape_for(model_cfg.size).vision.num_patches, model_cfg.action_horizon))


def batch_token_budget(batch: Pi05Batch, model_cfg: ModelConfig) -> int:
    """The tokens a packed batch had room for (rows x model.max_token_len, the packer's budget per row); 0 for an
    unpacked batch (rows None). batch_tokens / this is the packing efficiency the loop logs."""
    return 0 if batch.rows is None else len(batch.rows) * model_cfg.max_token_len
