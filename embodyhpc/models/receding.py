"""Receding-horizon acting, shared by the model families' evaluation runners (the spec's `inference` class).

A flow-matching policy predicts `model.action_horizon` steps; the first `execute_steps` are executed, then the policy
observes again and predicts a new chunk (pi0's and ACT's usual choice: long chunks for smooth motion, re-planning
often enough to correct). Sampling noise comes from a CPU generator seeded by the episode seed, so an episode is
reproducible whichever machine or shard runs it.

Batched (embodyhpc.eval.vector): one runner serves a shard's `envs_per_shard` episodes at once, each env with its
own action queue and noise generator (`reset(task, seed, env=i)`); `act_batch(observations, envs)` predicts the
chunks of all envs that need one in a single forward over their stacked observations (each env's noise drawn from
its own generator, so an episode's actions do not depend on which episodes share its batch).

A family subclasses RecedingHorizonRunner and writes only `observation_batch` (its observations -> its batch, on the
host); `predict_chunks` hands that batch to `sample_chunks`. RL (embodyhpc/rl) rebuilds the model batch of a stored
observation with the same `observation_batch`, so the actor scores exactly what the rollout acted on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Obs = Mapping[str, Any]


class RecedingHorizonRunner:
    """Action queues and noise generators per env over a model with `sample_actions(batch, num_steps=, noise=)`;
    on the device the model's parameters are on (embodyhpc.eval.trained.inference_placement puts it there)."""

    def __init__(self, model: Any, config: Any, *, normalizer: Any, execute_steps: int, denoise_steps: int,
                 num_action_dims: int) -> None:
        if not 1 <= execute_steps <= config.model.action_horizon:
            raise ValueError(f"execute_steps={execute_steps} must be in [1, model.action_horizon="
                             f"{config.model.action_horizon}]")
        self.model, self.config, self.normalizer = model.eval(), config, normalizer
        self.execute_steps, self.denoise_steps, self.num_action_dims = execute_steps, denoise_steps, num_action_dims
        self.device = next(model.parameters()).device
        # per env of a batched shard (env 0 for `act`): the actions left of its chunk, its noise generator (on the
        # CPU whatever the device, so the same seed gives the same noise on every machine)
        self._queues: dict[int, deque[np.ndarray]] = {}
        self._generators: dict[int, Any] = {}
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
        self._check_reset(envs)
        return self.sample_chunks(self.observation_batch(observations), envs)

    def observation_batch(self, observations: Sequence[Obs]) -> Any:
        """The model's batch (on the host, no actions) of these suite observations, fed exactly as in training: the
        family's part."""
        raise NotImplementedError

    def sample_chunks(self, batch: Any, envs: Sequence[int]) -> list[np.ndarray]:
        """The model's chunks for `batch` (one sample per env of `envs`, in order), each env's noise from its own
        generator; cut to num_action_dims, float32 on the host."""
        import torch

        shape = (self.config.model.action_horizon, self.config.model.action_dim)
        noise = torch.stack([torch.randn(shape, generator=self._generators[env]) for env in envs])
        with torch.inference_mode():
            actions = self.model.sample_actions(batch.to(self.device), num_steps=self.denoise_steps,
                                                noise=noise.to(self.device))
        self.chunks_predicted += len(envs)
        self.batches_predicted += 1
        return list(actions[:, :, : self.num_action_dims].float().cpu().numpy().astype(np.float32))

    def _check_reset(self, envs: Sequence[int]) -> None:
        missing = [env for env in envs if env not in self._queues]
        if missing:
            raise RuntimeError(f"call reset(task, seed, env={missing[0]}) before acting for that env")
