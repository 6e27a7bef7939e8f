"""The LeRobot side of bench/closed_loop_vs_act.py: runs inside the LeRobot venv, started by that bench.

    PATH/bin/python bench/closed_loop_act_side.py eval CONFIG.json      # roll an ACT checkpoint out, JSONL records
    PATH/bin/python bench/closed_loop_act_side.py digests CONFIG.json   # fingerprints of the episodes' states

It imports our evaluation code from this checkout (the repository root goes on sys.path; nothing is installed
into the venv) so that the ACT checkpoint runs through the same `make_suite` / `run_shard` as our policy: the
same (task, seed, episode) -> initial state, the same step limit and MetaWorld's own success flag. The venv needs
lerobot, metaworld and mujoco (the same versions as the project venv: the bench installs them so).

CONFIG.json (written by the bench):
    {"checkpoint": ".../pretrained_model", "episodes": [[task, seed, episode], ...], "out": "shard.jsonl",
     "max_steps": 200, "n_action_steps": null, "cameras": [], "image_size": 32, "threads": 1}
`digests` needs only "episodes" and "out" (a JSON file: {"task/seed/episode": sha256, ...}).

`episode_digests` is imported by the bench in the project venv too: both sides fingerprint the same episodes
(the state at reset and after 10 scripted-expert steps) and the bench compares the fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("MUJOCO_GL", "egl")

import numpy as np  # noqa: E402

from embodyhpc.eval.policies import ExpertPolicy  # noqa: E402
from embodyhpc.eval.shards import Episode  # noqa: E402
from embodyhpc.eval.suites import make_suite  # noqa: E402

IMAGE_PREFIX = "observation.images."
DIGEST_STEPS = 10


def episode_digests(episodes: list[Episode], steps: int = DIGEST_STEPS) -> dict[str, str]:
    """{"task/seed/episode": sha256 of the environment state at reset and after `steps` expert steps}."""
    tasks = list(dict.fromkeys(e.task for e in episodes))
    digests = {}
    with make_suite("metaworld", tasks) as suite:
        expert = ExpertPolicy(suite)
        for episode in episodes:
            env = suite.make_env(episode.task, episode.seed, episode.episode)
            try:
                expert.reset(episode.task, 0)
                obs = env.reset()
                digest = hashlib.sha256(np.asarray(obs["observation.environment_state"], np.float32).tobytes())
                for _ in range(steps):
                    obs, *_ = env.step(expert.act(obs))
                    digest.update(np.asarray(obs["observation.environment_state"], np.float32).tobytes())
            finally:
                env.close()
            digests[f"{episode.task}/{episode.seed}/{episode.episode}"] = digest.hexdigest()
    return digests


class ACTAdapter:
    """A LeRobot ACT checkpoint behind our Policy protocol (reset(task, seed), act(obs) -> float32 action).

    The checkpoint's own pre/post-processors (the normaliser with the training set's statistics) wrap the
    policy, as `lerobot-eval` does; `select_action` keeps ACT's action queue (n_action_steps per chunk).
    """

    def __init__(self, checkpoint: str, *, n_action_steps: int | None = None) -> None:
        import torch
        from lerobot.policies.act.modeling_act import ACTPolicy
        from lerobot.policies.factory import make_pre_post_processors

        self._torch = torch
        self.policy = ACTPolicy.from_pretrained(checkpoint)
        self.policy.config.device = "cpu"
        if n_action_steps:
            self.policy.config.n_action_steps = n_action_steps
        self.policy.eval()
        self.preprocess, self.postprocess = make_pre_post_processors(
            self.policy.config, pretrained_path=checkpoint,
            preprocessor_overrides={"device_processor": {"device": "cpu"}})
        self.inputs = list(self.policy.config.input_features)

    def reset(self, task: str, seed: int) -> None:
        self.policy.reset()  # empties the action queue; ACT's inference is deterministic (VAE latent = 0)

    def act(self, obs: dict[str, Any]) -> np.ndarray:
        torch = self._torch
        batch = {}
        for key in self.inputs:
            value = np.asarray(obs[key])
            if key.startswith(IMAGE_PREFIX):  # uint8 (H, W, 3) -> float (3, H, W) in [0, 1], as the dataset gives
                batch[key] = torch.from_numpy(np.ascontiguousarray(value)).permute(2, 0, 1).float() / 255.0
            else:
                batch[key] = torch.from_numpy(value.astype(np.float32))
        with torch.inference_mode():
            action = self.policy.select_action(self.preprocess(batch))
        return self.postprocess(action).reshape(-1).numpy().astype(np.float32)


def run_eval(config: dict[str, Any]) -> dict[str, Any]:
    import torch

    from embodyhpc.eval.rollout import run_shard

    torch.set_num_threads(int(config.get("threads", 1)))
    episodes = [Episode(*e) for e in config["episodes"]]
    policy = ACTAdapter(config["checkpoint"], n_action_steps=config.get("n_action_steps"))
    tasks = list(dict.fromkeys(e.task for e in episodes))
    with make_suite("metaworld", tasks, cameras=config.get("cameras", []),
                    image_size=int(config.get("image_size", 32))) as suite:
        summary = run_shard(suite, episodes, policy, config["out"], policy_name="act", video_dir=None,
                            max_steps=int(config["max_steps"]))
    return {**summary.to_dict(), "inputs": policy.inputs, "n_action_steps": policy.policy.config.n_action_steps,
            "chunk_size": policy.policy.config.chunk_size}


def main() -> int:
    command, config_path = sys.argv[1], sys.argv[2]
    config = json.loads(Path(config_path).read_text())
    if command == "digests":
        digests = episode_digests([Episode(*e) for e in config["episodes"]])
        Path(config["out"]).write_text(json.dumps(digests))
        print(json.dumps({"episodes": len(digests)}), flush=True)
    elif command == "eval":
        print(json.dumps(run_eval(config)), flush=True)
    else:
        raise SystemExit(f"unknown command {command!r} (eval | digests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
