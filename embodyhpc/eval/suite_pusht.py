"""The "pusht" evaluation suite: gym-pusht's PushT (push a T-shaped block onto a target), state or pixels.

One task, "pusht" (aliases "PushT-v0", "gym_pusht/PushT-v0"). Episode (task, seed, episode) resets the env with
`seed=episode_seed(task, seed, episode)`, which fixes the agent's and the block's start. Observations, keyed like
LeRobot's PushT datasets:

    observation.state              float32 (2,)   agent x, y (pixels of the 512 x 512 board)
    observation.environment_state  float32 (5,)   agent x, y, block x, y, block angle in [0, 2 pi): gym-pusht's
                                                  "state" observation
    observation.images.top         uint8 (S, S, 3) the board, only when cameras=("top",) (LeRobot's lerobot/pusht
                                                  calls this image "observation.image")
    task                           str

Actions: the agent's target position (x, y) in [0, 512]. Success: gym-pusht's criterion, coverage of the target
above the env's `success_threshold` (0.95); the env terminates there, so done = success. 300 steps at most
(gym-pusht's registered limit). There is no scripted expert (`has_expert = False`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from embodyhpc.eval.suites import Obs, check_action, episode_seed

TASK = "pusht"
ALIASES = {"pusht": TASK, "pusht-v0": TASK, "gym_pusht/pusht-v0": TASK}
CAMERA = "top"
INSTRUCTION = "Push the T-shaped block onto the T-shaped target."
MAX_STEPS = 300


def _env_class() -> Any:
    try:
        from gym_pusht.envs import PushTEnv
    except ImportError as exc:
        raise ImportError(f"gym-pusht is not installed ({exc}); pip install 'gym-pusht>=0.1.8' "
                          "(or the project's [sim] extra)") from exc
    return PushTEnv


class PushTEvalEnv:
    def __init__(self, suite: PushTSuite, seed: int, episode: int) -> None:
        self.task, self.seed, self.episode = TASK, seed, episode
        self.action_dim, self._suite = 2, suite
        self._pixels = bool(suite.cameras)
        self._env = _env_class()(obs_type="pixels_agent_pos" if self._pixels else "state",
                                 observation_width=suite.image_size, observation_height=suite.image_size,
                                 visualization_width=suite.video_size, visualization_height=suite.video_size)
        self.fps = int(self._env.metadata["render_fps"])

    def _obs(self, raw: Any, info: dict[str, Any]) -> Obs:
        block = np.asarray(info["block_pose"], dtype=np.float64)
        state = np.concatenate([info["pos_agent"], block[:2], [block[2] % (2 * np.pi)]]).astype(np.float32)
        obs: Obs = {"observation.state": state[:2].copy(), "observation.environment_state": state}
        if self._pixels:
            obs[f"observation.images.{CAMERA}"] = np.ascontiguousarray(raw["pixels"], dtype=np.uint8)
        obs["task"] = INSTRUCTION
        return obs

    def reset(self) -> Obs:
        raw, info = self._env.reset(seed=episode_seed(self.task, self.seed, self.episode))
        return self._obs(raw, info)

    def step(self, action: np.ndarray) -> tuple[Obs, float, bool, bool]:
        action = check_action(action, self.action_dim).astype(np.float64)
        raw, reward, terminated, truncated, info = self._env.step(action)
        success = bool(info["is_success"])
        return self._obs(raw, info), float(reward), success, bool(terminated or truncated)

    def render(self) -> np.ndarray:
        """The board at video_size, with the commanded target marked (gym-pusht's visualisation)."""
        return np.ascontiguousarray(self._env.render(), dtype=np.uint8)

    def close(self) -> None:
        self._env.close()


class PushTSuite:
    """gym-pusht's PushT; `make_suite("pusht", ["pusht"], cameras=("top",), image_size=96)` builds one."""

    name = "pusht"
    has_expert = False

    def __init__(self, tasks: Sequence[str], *, cameras: Sequence[str] = (), image_size: int = 96,
                 video_size: int = 192) -> None:
        unknown = [t for t in tasks if t.lower() not in ALIASES]
        if unknown or not tasks:
            raise ValueError(f"the pusht suite has one task, {TASK!r}; got {list(tasks)}")
        bad = [c for c in cameras if c != CAMERA]
        if bad or len(cameras) > 1:
            raise ValueError(f"pusht has one camera, {CAMERA!r}; got {list(cameras)}")
        _env_class()
        self.tasks, self.cameras = [TASK], tuple(cameras)
        self.image_size, self.video_size = image_size, video_size

    def instruction(self, task: str) -> str:
        self._check(task)
        return INSTRUCTION

    def max_steps(self, task: str) -> int:
        self._check(task)
        return MAX_STEPS

    def action_bounds(self, task: str) -> tuple[np.ndarray, np.ndarray]:
        self._check(task)
        return np.zeros(2, dtype=np.float32), np.full(2, 512, dtype=np.float32)

    def features(self, task: str) -> dict[str, dict[str, Any]]:
        self._check(task)
        features = {f"observation.images.{c}": {"dtype": "uint8", "shape": [self.image_size, self.image_size, 3]}
                    for c in self.cameras}
        features["observation.state"] = {"dtype": "float32", "shape": [2]}
        features["observation.environment_state"] = {"dtype": "float32", "shape": [5]}
        return features

    def make_env(self, task: str, seed: int, episode: int) -> PushTEvalEnv:
        self._check(task)
        episode_seed(task, seed, episode)  # validates
        return PushTEvalEnv(self, seed, episode)

    def expert_policy(self, task: str) -> Callable[[Obs], np.ndarray]:
        raise ValueError("gym-pusht ships no scripted expert: the pusht suite has no expert reference")

    def _check(self, task: str) -> None:
        if task.lower() not in ALIASES:
            raise ValueError(f"task {task!r} is not in the pusht suite (only {TASK!r})")

    def close(self) -> None:
        pass

    def __enter__(self) -> PushTSuite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
