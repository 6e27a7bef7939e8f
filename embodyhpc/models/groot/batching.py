"""LeRobot-style dataset items -> GR00T samples and batches (the spec's collate and token counts).

An item (embodyhpc.data.open_dataset with delta_timestamps on the action): observation.images.<camera> [3, H, W] in
[0, 1] (or with a leading time axis), the state at model.state_key, `action` [H, A], `action_is_pad` [H], `task`.

- Cameras in sorted key order, newest frame only, resized to the vision tower's input (bilinear, antialiased) here
  in the DataLoader workers rather than in the training step; uint8 images (data.image_dtype=uint8) stay uint8 at
  the camera's size, and the batch's `to()` converts and resizes them on the training device (batch.py).
- The instruction is tokenised and cut to what model.max_token_len leaves after the image tokens.
- The state (normalised by model.state_norm) is zero-padded to the model's max_state_dim (64) and read by the
  per-embodiment state encoder; a longer state is refused with the key that names it.
- Action dims are zero-padded to model.action_dim, and the loss counts only the real ones (GR00T trains one action
  width, 32, across robots); a longer action is refused: a trimmed dimension would never be learned.
- The chunk length must equal model.action_horizon (refused otherwise, with the delta_timestamps that fix it).
- model.packing packs each micro-batch's VLM tokens into rows of model.max_token_len (first-fit decreasing,
  embodyhpc.data.packing); the action side is the same size for every sample and is never padded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from embodyhpc.data.mixture import DATASET_INDEX_KEY, EMBODIMENT_KEY, normalizer_for
from embodyhpc.data.packing import first_fit_decreasing
from embodyhpc.errors import ConfigError
from embodyhpc.models.groot.batch import GrootBatch, GrootSample, collate
from embodyhpc.models.groot.build import max_text_tokens, options_of
from embodyhpc.models.groot.shapes import shape_for

IMAGE_PREFIX = "observation.images."
EMBODIMENT_NAMES = {"new_embodiment": 31, "gr1": 24, "agibot_genie1": 26, "oxe_droid": 17}
"""GR00T's names for the embodiment ids a data.datasets entry may give instead of a number 0..31."""


def embodiment_id(value: Any, num_embodiments: int = 32, entry: Any = "") -> int:
    """A data.datasets entry's embodiment (an id 0..31 or one of GR00T's names) as the id; one line if neither."""
    text = str(value).strip().lower()
    if text in EMBODIMENT_NAMES:
        return EMBODIMENT_NAMES[text]
    if text.isdigit() and int(text) < num_embodiments:
        return int(text)
    raise ConfigError(f"embodiment {value!r} is neither an id 0..{num_embodiments - 1} nor one of GR00T's names "
                      f"({', '.join(f'{k} {v}' for k, v in EMBODIMENT_NAMES.items())})",
                      key=f"data.datasets[{entry}].embodiment", fix="use new_embodiment (31) for a robot GR00T was not "
                                                             "pretrained on")


def newest(tensor: torch.Tensor, ndim: int) -> torch.Tensor:
    """Drop a leading history axis, keeping the newest frame."""
    if tensor.ndim == ndim + 1:
        return tensor[-1]
    if tensor.ndim != ndim:
        raise ValueError(f"expected {ndim} dims (or {ndim + 1} with a time axis), got {tuple(tensor.shape)}")
    return tensor


def resize_images(images: torch.Tensor, size: int) -> torch.Tensor:
    """[..., 3, H, W] -> [..., 3, size, size] float32, as the vision tower would resize."""
    if images.shape[-2:] == (size, size):
        return images.float()
    lead = images.shape[:-3]
    flat = torch.nn.functional.interpolate(images.reshape(-1, *images.shape[-3:]).float(), size=(size, size),
                                           mode="bilinear", align_corners=False, antialias=True)
    return flat.reshape(*lead, *flat.shape[1:])


def state_vector(value: Any, normalizer: Any, max_state_dim: int, key: str) -> torch.Tensor:
    state = newest(torch.as_tensor(value), 1).float()
    if normalizer is not None:
        state = torch.as_tensor(normalizer(state)).float()
    if state.shape[0] > max_state_dim:
        raise ConfigError(f"the state {key!r} has {state.shape[0]} dims, GR00T's state encoder reads at most "
                          f"{max_state_dim}", key="model.state_key", fix="name a shorter state feature")
    return torch.nn.functional.pad(state, (0, max_state_dim - state.shape[0]))


def to_groot_sample(item: Mapping[str, Any], model_cfg: Any, tokenizer: Any, normalizer: Any,
                    text_budget: int | None = None) -> GrootSample:
    shape = shape_for(model_cfg.size)
    # not `<camera>_is_pad`: the pad mask delta_timestamps on a camera adds (history frames)
    cameras = sorted(key for key in item if key.startswith(IMAGE_PREFIX) and not key.endswith("_is_pad"))
    if not cameras:
        raise ValueError(f"the item has no {IMAGE_PREFIX}* keys (keys: {', '.join(sorted(item))}): GR00T needs at "
                         "least one camera")
    images = torch.stack([newest(torch.as_tensor(item[key]), 3) for key in cameras])
    if images.dtype != torch.uint8:  # uint8: converted and resized in GrootBatch.to(), on the training device
        images = resize_images(images, shape.vision.image_size)
    key = model_cfg.state_key
    if key not in item:
        raise ConfigError(f"the dataset has no {key!r} (keys: {', '.join(sorted(item))})", key="model.state_key",
                          fix="name a vector feature of the dataset")
    state = state_vector(item[key], normalizer_for(normalizer, item), shape.head.max_state_dim, key)
    embodiment = embodiment_id(item[EMBODIMENT_KEY], shape.head.num_embodiments, item.get(DATASET_INDEX_KEY, "")) \
        if EMBODIMENT_KEY in item else None
    budget = text_budget if text_budget is not None else max_text_tokens(model_cfg, len(cameras))
    text_ids = list(tokenizer.encode(str(item.get("task", ""))))[:budget]
    actions = item.get("action")
    if actions is None:
        return GrootSample(images=images, text_ids=text_ids, state=state, embodiment=embodiment)
    actions = torch.as_tensor(actions).float()
    horizon = model_cfg.action_horizon
    if actions.ndim != 2 or actions.shape[0] != horizon:
        raise ConfigError(
            f"the dataset's action chunk has shape {tuple(actions.shape)}, the model predicts {horizon} steps "
            f"(model.action_horizon={horizon})", key="data.delta_timestamps", related=("model.action_horizon",),
            fix=f"set data.delta_timestamps.action to {horizon} offsets, e.g. [i / fps for i in range({horizon})]")
    num_dims = actions.shape[1]
    if num_dims > model_cfg.action_dim:
        raise ConfigError(f"the dataset has {num_dims} action dims, more than model.action_dim="
                          f"{model_cfg.action_dim}", key="model.action_dim", fix=f"set model.action_dim={num_dims}")
    actions = torch.nn.functional.pad(actions, (0, model_cfg.action_dim - num_dims))
    is_pad = item.get("action_is_pad")
    return GrootSample(images=images, text_ids=text_ids, state=state, actions=actions,
                       action_is_pad=None if is_pad is None else torch.as_tensor(is_pad).bool(),
                       num_action_dims=num_dims, embodiment=embodiment)


class GrootCollate:
    """DataLoader collate_fn (picklable): items -> one GrootBatch, packed when model.packing."""

    def __init__(self, model_cfg: Any, tokenizer: Any, normalizer: Any = None) -> None:
        self.model_cfg, self.tokenizer, self.normalizer = model_cfg, tokenizer, normalizer
        self.embodiment_id = options_of(model_cfg).embodiment_id
        self.num_patches = shape_for(model_cfg.size).vision.num_patches

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> GrootBatch:
        samples = [to_groot_sample(item, self.model_cfg, self.tokenizer, self.normalizer) for item in items]
        batch = collate(samples, embodiment_id=self.embodiment_id)
        if batch.images.dtype == torch.uint8:
            batch = replace(batch, image_size=shape_for(self.model_cfg.size).vision.image_size)
        if self.model_cfg.packing:
            lengths = batch.token_counts(self.num_patches)
            batch = replace(batch, rows=first_fit_decreasing(lengths, self.model_cfg.max_token_len))
        return batch


def batch_tokens(batch: GrootBatch, model_cfg: Any) -> int:
    """VLM tokens of the batch (image patches + instructions, padding excluded): tokens_per_s counts these, the
    tokens that packing places (the action side is 1 + 32 + 16 tokens per sample at full size, never padded)."""
    return sum(batch.token_counts(shape_for(model_cfg.size).vision.num_patches))


def batch_token_budget(batch: GrootBatch, model_cfg: Any) -> int:
    """rows x model.max_token_len for a packed batch; 0 unpacked."""
    return 0 if batch.rows is None else len(batch.rows) * model_cfg.max_token_len
