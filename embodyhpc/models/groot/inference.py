"""GR00T inside the evaluation loop (the spec's `inference`): receding-horizon action chunks from loaded weights.

    policy = GrootRunner(model, config, normalizer=normalizer, execute_steps=8, denoise_steps=4, num_action_dims=7)
    policy.reset(task, seed[, env])   # before every episode
    action = policy.act(obs)          # or act_batch(observations, envs) for a batched shard

Observations are fed exactly as in training (batching.to_groot_sample: same cameras in sorted order, resize, state
key, statistics and padding, instruction budget). Each env's noise comes from a CPU generator seeded by its episode
seed, so an episode's actions do not depend on the machine or on which episodes share its batch. GR00T-N1.5 samples
with 4 Euler steps (eval.denoise_steps: 4 in the GR00T recipes).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Obs = Mapping[str, Any]


class GrootRunner:
    def __init__(self, model: Any, config: Any, *, normalizer: Any, execute_steps: int, denoise_steps: int,
                 num_action_dims: int) -> None:
        from embodyhpc.models import build_tokenizer
        from embodyhpc.models.groot.build import options_of

        if not 1 <= execute_steps <= config.model.action_horizon:
            raise ValueError(f"execute_steps={execute_steps} must be in [1, model.action_horizon="
                             f"{config.model.action_horizon}]")
        self.model, self.config, self.normalizer = model.eval(), config, normalizer
        self.execute_steps, self.denoise_steps, self.num_action_dims = execute_steps, denoise_steps, num_action_dims
        self._tokenizer = build_tokenizer(config.model)
        self._embodiment_id = options_of(config.model).embodiment_id
        self.device = next(model.parameters()).device
        self._queues: dict[int, deque[np.ndarray]] = {}
        self._generators: dict[int, Any] = {}
        self.chunks_predicted = 0
        self.step: int | None = None

    def reset(self, task: str, seed: int, env: int = 0) -> None:
        import torch

        self._queues[env] = deque()
        self._generators[env] = torch.Generator().manual_seed(int(seed))

    def act(self, obs: Obs) -> np.ndarray:
        return self.act_batch([obs], [0])[0]

    def act_batch(self, observations: Sequence[Obs], envs: Sequence[int]) -> list[np.ndarray]:
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
        return not self._queues.get(env)

    def predict_chunks(self, observations: Sequence[Obs], envs: Sequence[int]) -> list[np.ndarray]:
        """[horizon, num_action_dims] float32 actions per observation, in one batch."""
        import torch

        from embodyhpc.models.groot.batch import collate
        from embodyhpc.models.groot.batching import to_groot_sample

        self._check_reset(envs)
        samples = [to_groot_sample(self._item(obs), self.config.model, self._tokenizer, self.normalizer)
                   for obs in observations]
        batch = collate(samples, embodiment_id=self._embodiment_id)
        shape = (self.config.model.action_horizon, self.config.model.action_dim)
        noise = torch.stack([torch.randn(shape, generator=self._generators[env]) for env in envs])
        with torch.inference_mode():
            actions = self.model.sample_actions(batch.to(self.device), num_steps=self.denoise_steps,
                                                noise=noise.to(self.device))
        self.chunks_predicted += len(samples)
        return list(actions[:, :, : self.num_action_dims].float().cpu().numpy().astype(np.float32))

    def _check_reset(self, envs: Sequence[int]) -> None:
        missing = [env for env in envs if env not in self._queues]
        if missing:
            raise RuntimeError(f"call reset(task, seed, env={missing[0]}) before acting for that env")

    def _item(self, obs: Obs) -> dict[str, Any]:
        """A suite observation (HWC uint8 cameras) as a dataset item (CHW float in [0, 1])."""
        import torch

        key = self.config.model.state_key
        if key not in obs:
            raise KeyError(f"the policy was trained on {key!r}; the suite's observations have "
                           f"{', '.join(sorted(obs))}")
        item: dict[str, Any] = {key: np.asarray(obs[key], np.float32), "task": str(obs.get("task", ""))}
        for name, value in obs.items():
            if name.startswith("observation.images."):
                item[name] = torch.from_numpy(np.ascontiguousarray(value)).permute(2, 0, 1).float() / 255.0
        return item
