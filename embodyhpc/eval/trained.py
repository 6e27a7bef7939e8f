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

Batched (embodyhpc.eval.vector): one policy serves a shard's `envs_per_shard` episodes at once, each env with its
own action queue and noise generator (`reset(task, seed, env=i)`); `act_batch(observations, envs)` predicts the
chunks of all envs that need one in a single forward over their stacked observations (each env's noise drawn from
its own generator, so an episode's actions do not depend on which episodes share its batch).

Placement (`inference_placement`): a shard with a GPU (eval.gpus_per_task) runs the policy there in bf16, a CPU
shard in fp32.
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from embodyhpc.eval.suites import Obs

IMAGE_PREFIX = "observation.images."
POLICY_IO_FILE = "policy_io.json"
"""Written by the training job into the export: the dataset's real action dims, cameras and state key."""


def inference_placement(gpus_per_task: int) -> tuple[str, Any]:
    """(device, dtype) of the policy on a shard with `gpus_per_task` GPUs: ("cuda", bfloat16) with GPUs (the shard's
    first), ("cpu", float32) without. Asking for GPUs where CUDA sees none is a runtime failure, not a silent CPU
    run."""
    import torch

    if gpus_per_task <= 0:
        return "cpu", torch.float32
    if not torch.cuda.is_available():
        raise RuntimeError(f"the evaluation asks for {gpus_per_task} GPU(s) per shard (eval.gpus_per_task) but CUDA "
                           "sees none on this node; set eval.gpus_per_task=0 to evaluate on CPUs")
    return "cuda", torch.bfloat16


class TrainedPolicy:
    def __init__(self, model: Any, config: Any, *, normalizer: Any, execute_steps: int, denoise_steps: int,
                 num_action_dims: int, device: str = "cpu") -> None:
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
        self.device = torch.device(device)
        # per env of a batched shard (env 0 for `act`): the actions left of its chunk, its noise generator (on the
        # CPU whatever the device, so the same seed gives the same noise on every machine)
        self._queues: dict[int, deque[np.ndarray]] = {}
        self._generators: dict[int, torch.Generator] = {}
        self.chunks_predicted = 0
        self.batches_predicted = 0
        self.step: int | None = None
        """The training step of the weights (from the export), None when unknown."""

    @classmethod
    def from_export(cls, export_dir: str | os.PathLike, *, execute_steps: int, denoise_steps: int = 10,
                    threads: int | None = None, gpus: int = 0) -> TrainedPolicy:
        """The exported policy, on the shard's GPU in bf16 when `gpus` (eval.gpus_per_task) > 0, else on the CPU in
        fp32 whatever the training precision was."""
        import torch

        from embodyhpc.checkpoint.export import CONFIG_FILE, check_fits, load_exported
        from embodyhpc.config.load import load_config_file
        from embodyhpc.data.normalize import StateNormalizer
        from embodyhpc.models import build_model

        if threads:
            torch.set_num_threads(threads)
        export_dir = Path(export_dir)
        weights, summary = load_exported(export_dir)  # checked against export.json's size and sha256
        config = load_config_file(export_dir / CONFIG_FILE)
        check_fits({k: (v.dtype, v.shape) for k, v in weights.items()}, config.model, config.precision,
                   where=str(export_dir), built_with=str(export_dir / CONFIG_FILE))
        model = build_model(config.model, config.precision)
        model.load_state_dict(weights, strict=True)
        device, dtype = inference_placement(gpus)
        model.to(device=device, dtype=dtype)
        normalizer = StateNormalizer.load(export_dir) or StateNormalizer(config.model.state_key, "none")
        dims = read_policy_io(export_dir).get("action_dim") or config.model.action_dim
        policy = cls(model, config, normalizer=normalizer, execute_steps=execute_steps, denoise_steps=denoise_steps,
                     num_action_dims=dims, device=device)
        policy.step = summary.get("step")
        return policy

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

        from embodyhpc.models.pi05 import collate
        from embodyhpc.train.adapter import resize_images

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

        from embodyhpc.models.pi05 import Pi05Sample

        cameras = sorted(key for key in obs if key.startswith(IMAGE_PREFIX))
        images = torch.stack([torch.from_numpy(np.ascontiguousarray(obs[key])).permute(2, 0, 1).float() / 255.0
                              for key in cameras])
        key = self.config.model.state_key
        if key not in obs:
            raise KeyError(f"the policy was trained on {key!r}; the suite's observations have "
                           f"{', '.join(sorted(obs))}")
        state = torch.as_tensor(self.normalizer(np.asarray(obs[key], np.float32)))
        return Pi05Sample(images=images, instruction=str(obs.get("task", "")), state=state)


def read_policy_io(export_dir: Path) -> dict[str, Any]:
    """What the training job recorded about the dataset next to the weights (POLICY_IO_FILE)."""
    import json

    path = export_dir / POLICY_IO_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
