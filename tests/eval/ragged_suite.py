"""A deterministic suite whose episodes end at different steps, for batched-evaluation tests that leave lockstep.

Ledger world: a point on a line. Episode (task, seed, episode) starts at x0 = -(episode % 3) - 0.125 * seed and
moves by the action each step; reward x after the step, success at x >= goal, done after `lengths[episode %
len(lengths)]` steps (so the envs of a batched shard finish at different steps). Observations: "observation.state"
= [x, steps so far], "observation.images.cam" (what a camera shows of x: uint8 (2, 2, 3)) unless the rollout said
the next observation is not read (`observe_images(False)`), "task".

With `log_dir`, each env writes its trajectory when closed to `<log_dir>/<task>-<seed>-<episode>.json`: the states
it showed, the actions it received, its rewards, successes and dones, in step order: what the env saw, whichever
process or batch position drove it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def camera_value(x: float) -> int:
    return int(np.clip(round(100 + 20 * x), 0, 255))


class LedgerEnv:
    action_dim, fps = 1, 10

    def __init__(self, task: str, seed: int, episode: int, *, length: int, goal: float, log_dir: str | None) -> None:
        self.task, self.seed, self.episode = task, seed, episode
        self.length, self.goal, self.log_dir = length, goal, log_dir
        self.log: dict[str, list] = {"states": [], "actions": [], "rewards": [], "successes": [], "dones": []}
        self._observe = True

    def _obs(self) -> dict:
        state = np.array([self.x, self.steps], dtype=np.float32)
        self.log["states"].append(state.tolist())
        obs = {"observation.state": state, "task": self.task}
        if self._observe:
            obs["observation.images.cam"] = np.full((2, 2, 3), camera_value(self.x), dtype=np.uint8)
        return obs

    def reset(self) -> dict:
        self.x, self.steps, self._observe = -float(self.episode % 3) - 0.125 * self.seed, 0, True
        return self._obs()

    def observe_images(self, on: bool) -> None:
        self._observe = bool(on)

    def step(self, action):
        action = np.asarray(action, dtype=np.float32).reshape(-1)
        self.x += float(np.clip(action[0], -1.0, 1.0))
        self.steps += 1
        success, done = self.x >= self.goal, self.steps >= self.length
        self.log["actions"].append(action.tolist())
        self.log["rewards"].append(self.x)
        self.log["successes"].append(bool(success))
        self.log["dones"].append(bool(done))
        return self._obs(), self.x, success, done

    def render(self) -> np.ndarray:
        return np.full((16, 16, 3), camera_value(self.x), dtype=np.uint8)

    def close(self) -> None:
        if self.log_dir is not None:
            path = Path(self.log_dir) / f"{self.task}-{self.seed}-{self.episode}.json"
            path.write_text(json.dumps(self.log))


class LedgerSuite:
    name, has_expert = "ledger", False

    def __init__(self, tasks, *, cameras=(), image_size=2, lengths=(5,), goal=2.0, limit=20, log_dir=None):
        self.tasks, self.cameras, self.image_size = list(tasks), tuple(cameras), image_size
        self.lengths, self.goal, self.limit, self.log_dir = tuple(lengths), goal, limit, log_dir

    def instruction(self, task):
        return task

    def max_steps(self, task):
        return self.limit

    def action_bounds(self, task):
        return np.array([-1.0], dtype=np.float32), np.array([1.0], dtype=np.float32)

    def features(self, task):
        return {"observation.state": {"dtype": "float32", "shape": [2]}}

    def make_env(self, task, seed, episode):
        return LedgerEnv(task, seed, episode, length=self.lengths[episode % len(self.lengths)], goal=self.goal,
                         log_dir=self.log_dir)

    def expert_policy(self, task):
        raise ValueError("no expert")

    def close(self):
        pass
