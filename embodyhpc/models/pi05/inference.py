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

Batched (embodyhpc.eval.vector): one runner serves a shard's `envs_per_shard` episodes at once, each env with its
own action queue and noise generator (`reset(task, seed, env=i)`); `act_batch(observations, envs)` predicts the
chunks of all envs that need one in a single forward over their stacked observations (each env's noise drawn from
its own generator, so an episode's actions do not depend on which episodes share its batch).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

IMAGE_PREFIX = "observation.images."
Obs = Mapping[str, Any]


class Pi05Runner:
    """pi0.5 acting in a suite from loaded weights (the spec's `inference`), in receding-horizon chunks; on the device
    the model's parameters are on (embodyhpc.eval.trained.inference_placement puts it there)."""

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
        self.device = next(model.parameters()).device
        # per env of a batched shard (env 0 for `act`): the actions left of its chunk, its noise generator (on the
        # CPU whatever the device, so the same seed gives the same noise on every machine)
        self._queues: dict[int, deque[np.ndarray]] = {}
        self._generators: dict[int, torch.Generator] = {}
        self.chunks_predicted = 0
        self.batches_predicted = 0
        self.step: int | None = None
        """The training step of the weights (from the export), None when unknown."""

    def reset(self, task: str, seed: int, env: int = 0) -> None:
        import torch

        self._queues[env] = deque()
        self._generators[env] = torch.Generator().manual_seed(int(seed))

    def act(self, obs: Obs) -> np.ndarray:
        return self.act_batch([obs], [0])[0]

    def act_batch(self, observations: Sequence[Obs], envs: Sequence[int]) -> list[np.ndarray]:
        """The next action of each env in `envs` (observations[i] is env envs[i]'s); the envs whose queue is empty
        get new chunks from one forward over their stacked observations."""
        if len(observations) != len(envs):
            raise ValueError(f"{len(observations)} observations for {len(envs)} envs")
        self._check_reset(envs)
        replan = [i for i, env in enumerate(envs) if not self._queues[env]]
        if replan:
            chunks = self.predict_chunks([observations[i] for i in replan], [envs[i] for i in replan])
            for i, chunk in zip(replan, chunks, strict=True):
                self._queues[envs[i]].extend(chunk[: self.execute_steps])
        return [self._queues[env].popleft() for env in envs]

    def reads_next_observation(self, env: int = 0) -> bool:
        """Whether env's next `act` predicts a chunk (reads its observation) or executes a queued action."""
        return not self._queues.get(env)

    def predict_chunk(self, obs: Obs, env: int = 0) -> np.ndarray:
        """[horizon, num_action_dims] float32 actions for one observation."""
        return self.predict_chunks([obs], [env])[0]

    def predict_chunks(self, observations: Sequence[Obs], envs: Sequence[int]) -> list[np.ndarray]:
        """[horizon, num_action_dims] float32 actions per observation, in one batch; env envs[i]'s generator
        draws observations[i]'s noise."""
        import torch

        from embodyhpc.models.pi05.batch import collate
        from embodyhpc.models.pi05.batching import resize_images

        self._check_reset(envs)
        samples = [self._sample(obs) for obs in observations]
        num_cameras = samples[0].images.shape[0]
        if any(sample.images.shape != samples[0].images.shape for sample in samples):
            raise ValueError("a batch of observations needs the same cameras at the same size in each")
        batch = collate(samples, self._tokenizer, max_prompt_tokens=self._budget_for(num_cameras),
                        include_state=self.config.model.state_input == "prompt")
        batch = dataclasses.replace(batch, images=resize_images(batch.images, self._image_size))
        shape = (self.config.model.action_horizon, self.config.model.action_dim)
        noise = torch.stack([torch.randn(shape, generator=self._generators[env]) for env in envs])
        with torch.inference_mode():
            actions = self.model.sample_actions(batch.to(self.device), num_steps=self.denoise_steps,
                                                noise=noise.to(self.device))
        self.chunks_predicted += len(samples)
        self.batches_predicted += 1
        actions = actions[:, :, : self.num_action_dims].float().cpu().numpy().astype(np.float32)
        return list(actions)

    def _check_reset(self, envs: Sequence[int]) -> None:
        missing = [env for env in envs if env not in self._queues]
        if missing:
            raise RuntimeError(f"call reset(task, seed, env={missing[0]}) before acting for that env")

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
