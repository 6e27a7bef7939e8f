"""A trained policy inside the evaluation loop: pi0.5 from exported weights, acting in action chunks.

    policy = TrainedPolicy.from_export(run_dir / "export", execute_steps=5, denoise_steps=10)
    policy.reset(task, seed)          # before every episode
    action = policy.act(obs)          # obs: the suite's observation dict (embodyhpc.eval.suites)

The export folder (embodyhpc.checkpoint.export) holds model.safetensors, config.yaml (the resolved recipe) and,
when the recipe normalised the state, normalization.json: the policy sees observations exactly as in training
(same cameras in the same order, same state key and statistics, images resized the same way).

Receding horizon: the model predicts `model.action_horizon` steps; the first `execute_steps` are executed, then
the policy observes again and predicts a new chunk (pi0's and ACT's usual choice: long chunks for smooth motion,
re-planning often enough to correct). Sampling noise comes from a generator seeded by the episode seed, so an
episode is reproducible whichever shard runs it.
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from embodyhpc.eval.suites import Obs

IMAGE_PREFIX = "observation.images."
POLICY_IO_FILE = "policy_io.json"
"""Written by the training job into the export: the dataset's real action dims, cameras and state key."""


class TrainedPolicy:
    def __init__(self, model: Any, config: Any, *, normalizer: Any, execute_steps: int, denoise_steps: int,
                 num_action_dims: int) -> None:
        import torch

        from embodyhpc.models import build_tokenizer
        from embodyhpc.models.pi05 import max_prompt_tokens, shape_for

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

    @classmethod
    def from_export(cls, export_dir: str | os.PathLike, *, execute_steps: int, denoise_steps: int = 10,
                    threads: int | None = None) -> TrainedPolicy:
        import torch

        from embodyhpc.checkpoint.export import CONFIG_FILE, load_exported
        from embodyhpc.config.load import load_config_file
        from embodyhpc.data.normalize import StateNormalizer
        from embodyhpc.models import build_model

        if threads:
            torch.set_num_threads(threads)
        export_dir = Path(export_dir)
        weights, summary = load_exported(export_dir)
        config = load_config_file(export_dir / CONFIG_FILE)
        model = build_model(config.model, config.precision)
        missing, unexpected = model.load_state_dict(weights, strict=False)
        if missing or unexpected:
            raise RuntimeError(f"{export_dir}: the exported weights do not fit the model the recipe builds "
                               f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]})")
        model.float()  # evaluation runs in fp32 on the CPU whatever the training precision was
        normalizer = StateNormalizer.load(export_dir) or StateNormalizer(config.model.state_key, "none")
        dims = read_policy_io(export_dir).get("action_dim") or config.model.action_dim
        policy = cls(model, config, normalizer=normalizer, execute_steps=execute_steps, denoise_steps=denoise_steps,
                     num_action_dims=dims)
        policy.step = summary.get("step")
        return policy

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

        from embodyhpc.models.pi05 import Pi05Sample, collate
        from embodyhpc.train.adapter import resize_images

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


def read_policy_io(export_dir: Path) -> dict[str, Any]:
    """What the training job recorded about the dataset next to the weights (POLICY_IO_FILE)."""
    import json

    path = export_dir / POLICY_IO_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
