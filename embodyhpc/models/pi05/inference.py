"""pi0.5 inside the evaluation loop (the spec's `inference`): acting in action chunks from loaded weights.

    policy = Pi05Runner(model, config, normalizer=normalizer, execute_steps=5, denoise_steps=10, num_action_dims=4)
    policy.reset(task, seed)          # before every episode
    action = policy.act(obs)          # obs: the suite's observation dict (embodyhpc.eval.suites)

embodyhpc/eval/trained.py loads the export (weights, recipe, state statistics, policy io) for any model and builds
this class with them: the policy sees observations exactly as in training (same cameras in the same order, same
state key and statistics, images resized the same way).

Receding horizon, one action queue and noise generator per env of a batched shard: models/receding.py (shared by
the families); this class only turns observations into pi0.5's batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from embodyhpc.models.receding import Obs, RecedingHorizonRunner

IMAGE_PREFIX = "observation.images."


class Pi05Runner(RecedingHorizonRunner):
    """pi0.5 acting in a suite from loaded weights (the spec's `inference`), in receding-horizon chunks; on the device
    the model's parameters are on (embodyhpc.eval.trained.inference_placement puts it there)."""

    def __init__(self, model: Any, config: Any, *, normalizer: Any, execute_steps: int, denoise_steps: int,
                 num_action_dims: int) -> None:
        from embodyhpc.models import build_tokenizer
        from embodyhpc.models.pi05.build import max_prompt_tokens
        from embodyhpc.models.pi05.shapes import shape_for

        super().__init__(model, config, normalizer=normalizer, execute_steps=execute_steps,
                         denoise_steps=denoise_steps, num_action_dims=num_action_dims)
        self._tokenizer = build_tokenizer(config.model)
        self._image_size = shape_for(config.model.size).vision.image_size
        self._budget_for = lambda cameras: max_prompt_tokens(config.model, cameras)

    def observation_batch(self, observations: Sequence[Obs]) -> Any:
        """pi0.5's batch (host, no actions) of these observations, as training fed them."""
        from embodyhpc.models.pi05.batch import collate
        from embodyhpc.models.pi05.batching import resize_images

        samples = [self._sample(obs) for obs in observations]
        num_cameras = samples[0].images.shape[0]
        if any(sample.images.shape != samples[0].images.shape for sample in samples):
            raise ValueError("a batch of observations needs the same cameras at the same size in each")
        batch = collate(samples, self._tokenizer, max_prompt_tokens=self._budget_for(num_cameras),
                        include_state=self.config.model.state_input == "prompt")
        return dataclasses.replace(batch, images=resize_images(batch.images, self._image_size))

    def _sample(self, obs: Obs) -> Any:
        import torch

        from embodyhpc.models.pi05.batch import Pi05Sample

        cameras = sorted(key for key in obs if key.startswith(IMAGE_PREFIX))
        images = torch.stack([torch.from_numpy(np.ascontiguousarray(obs[key])).permute(2, 0, 1).float() / 255.0
                              for key in cameras])
        key = self.config.model.state_key
        if key not in obs:
            raise KeyError(f"the policy was trained on {key!r}; the suite's observations have "
                           f"{', '.join(sorted(obs))}")
        state = torch.as_tensor(self.normalizer(np.asarray(obs[key], np.float32)))
        return Pi05Sample(images=images, instruction=str(obs.get("task", "")), state=state)
