"""pi0.5 inside the evaluation loop (the spec's `inference`): acting in action chunks from loaded weights.

    policy = Pi05Runner(model, config, normalizer=normalizer, execute_steps=5, denoise_steps=10, num_action_dims=4)
    policy.reset(task, seed)          # before every episode
    action = policy.act(obs)          # obs: the suite's observation dict (embodyhpc.eval.suites)

embodyhpc/eval/trained.py loads the export (weights, recipe, state statistics, policy io) for any model and builds
this class with them: the policy sees observations exactly as in training (same cameras in the same order, same
state key and statistics, images resized the same way).

Receding horizon: the model predicts `model.action_horizon` steps; the first `execute_steps` are executed, then
the policy observes again and predicts a new chunk (pi0's and ACT's usual choice: long chunks for smooth motion,
re-planning often enough to correct). Sampling noise comes from a generator seeded by the episode seed, so an
episode is reproducible whichever shard runs it.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

IMAGE_PREFIX = "observation.images."
Obs = Mapping[str, Any]


class Pi05Runner:
    """pi0.5 acting in a suite from loaded weights (the spec's `inference`), in receding-horizon chunks."""

    def __init__(self, model: Any, config: Any, *, normalizer: Any, execute_steps: int, denoise_steps: int,
                 num_action_dims: int) -> None:
        import torch

        from embodyhpc.models import build_tokenizer
        from embodyhpc.models.pi05.build import max_prompt_tokens
        from embodyhpc.models.pi05.shapes import shape_for

        if not 1 <= execute_steps <= config.model.action_horizon:
            raise ValueError(f"execute_steps={execute_steps} must be in [1, model.action_horizon="
                             f"{config.model.action_horizon}]")
        self.model, self.config = model.eval(), config
        self.normalizer = normalizer
        self.execute_steps, self.denoise_steps = execute_steps, denoise_steps
        self.num_action_dims = num_action_dims
        self._tokenizer = build_tokenizer(config.model)
        self._image_size = shape_for(config.model.size).vision.image_size
        self._budget_for = lambda cameras: max_prompt_tokens(config.model, cameras)
        self._queue: deque[np.ndarray] = deque()
        self._generator = torch.Generator().manual_seed(0)
        self.chunks_predicted = 0
        self.step: int | None = None
        """The training step of the weights (from the export), None when unknown."""

    def reset(self, task: str, seed: int) -> None:
        self._queue.clear()
        self._generator.manual_seed(int(seed))

    def act(self, obs: Obs) -> np.ndarray:
        if not self._queue:
            chunk = self.predict_chunk(obs)
            self._queue.extend(chunk[: self.execute_steps])
        return self._queue.popleft()

    def reads_next_observation(self) -> bool:
        """Whether the next `act` predicts a chunk (reads its observation) or executes a queued action."""
        return not self._queue

    def predict_chunk(self, obs: Obs) -> np.ndarray:
        """[horizon, num_action_dims] float32 actions for one observation."""
        import torch

        from embodyhpc.models.pi05.batch import Pi05Sample, collate
        from embodyhpc.models.pi05.batching import resize_images

        cameras = sorted(key for key in obs if key.startswith(IMAGE_PREFIX))
        images = torch.stack([torch.from_numpy(np.ascontiguousarray(obs[key])).permute(2, 0, 1).float() / 255.0
                              for key in cameras])
        key = self.config.model.state_key
        if key not in obs:
            raise KeyError(f"the policy was trained on {key!r}; the suite's observations have "
                           f"{', '.join(sorted(obs))}")
        state = torch.as_tensor(self.normalizer(np.asarray(obs[key], np.float32)))
        sample = Pi05Sample(images=images, instruction=str(obs.get("task", "")), state=state)
        batch = collate([sample], self._tokenizer, max_prompt_tokens=self._budget_for(len(cameras)),
                        include_state=self.config.model.state_input == "prompt")
        batch = dataclasses.replace(batch, images=resize_images(batch.images, self._image_size))
        with torch.inference_mode():
            actions = self.model.sample_actions(batch, num_steps=self.denoise_steps, generator=self._generator)
        self.chunks_predicted += 1
        return actions[0, :, : self.num_action_dims].numpy().astype(np.float32)
