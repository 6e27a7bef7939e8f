"""GR00T inside the evaluation loop (the spec's `inference`): receding-horizon action chunks from loaded weights.

    policy = GrootRunner(model, config, normalizer=normalizer, execute_steps=8, denoise_steps=4, num_action_dims=7)
    policy.reset(task, seed[, env])   # before every episode
    action = policy.act(obs)          # or act_batch(observations, envs) for a batched shard

Observations are fed exactly as in training (batching.to_groot_sample: same cameras in sorted order, resize, state
key, statistics and padding, instruction budget). Receding horizon, one action queue and noise generator per env
(seeded by its episode seed): models/receding.py, shared by the families. GR00T-N1.5 samples with 4 Euler steps
(eval.denoise_steps: 4 in the GR00T recipes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from embodyhpc.models.receding import Obs, RecedingHorizonRunner


class GrootRunner(RecedingHorizonRunner):
    """GR00T acting in a suite from loaded weights (the spec's `inference`), in receding-horizon chunks."""

    def __init__(self, model: Any, config: Any, *, normalizer: Any, execute_steps: int, denoise_steps: int,
                 num_action_dims: int) -> None:
        from embodyhpc.models import build_tokenizer
        from embodyhpc.models.groot.build import options_of

        super().__init__(model, config, normalizer=normalizer, execute_steps=execute_steps,
                         denoise_steps=denoise_steps, num_action_dims=num_action_dims)
        self._tokenizer = build_tokenizer(config.model)
        self._embodiment_id = options_of(config.model).embodiment_id

    def observation_batch(self, observations: Sequence[Obs]) -> Any:
        """GR00T's batch (host, no actions) of these observations, as training fed them."""
        from embodyhpc.models.groot.batch import collate
        from embodyhpc.models.groot.batching import to_groot_sample

        samples = [to_groot_sample(self._item(obs), self.config.model, self._tokenizer, self.normalizer)
                   for obs in observations]
        return collate(samples, embodiment_id=self._embodiment_id)

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
