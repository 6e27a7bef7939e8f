"""A tiny deterministic suite with no simulator behind it, for rollout and registry tests.

Walk along a line: the agent starts at -(seed + episode) % 7 - 1 and moves by the action each step (clipped to
[-1, 1]); reward 1 per step at position >= 0, success at position >= goal (3), done after `limit` steps.
"""

from __future__ import annotations

import numpy as np


class LineEnv:
    def __init__(self, task: str, seed: int, episode: int, limit: int, image_size: int) -> None:
        self.task, self.seed, self.episode = task, seed, episode
        self.action_dim, self.fps = 1, 10
        self.limit, self.image_size, self.closed = limit, image_size, False

    def _obs(self):
        return {"observation.state": np.array([self.position], dtype=np.float32), "task": f"walk to {3}"}

    def reset(self):
        self.position, self.steps = -float((self.seed + self.episode) % 7) - 1.0, 0
        return self._obs()

    def step(self, action):
        self.position += float(np.clip(action[0], -1, 1))
        self.steps += 1
        return self._obs(), float(self.position >= 0), self.position >= 3, self.steps >= self.limit

    def render(self):
        frame = np.zeros((self.image_size, self.image_size, 3), dtype=np.uint8)
        frame[..., 0] = min(255, 30 * self.steps)
        return frame

    def close(self):
        self.closed = True


class LineSuite:
    name, has_expert = "line", False

    def __init__(self, tasks, *, cameras=(), image_size=16, limit=20):
        self.tasks, self.cameras, self.image_size, self.limit = list(tasks), tuple(cameras), image_size, limit
        self.opened: list[LineEnv] = []

    def instruction(self, task):
        return "walk to 3"

    def max_steps(self, task):
        return self.limit

    def action_bounds(self, task):
        return np.array([-1.0], dtype=np.float32), np.array([1.0], dtype=np.float32)

    def features(self, task):
        return {"observation.state": {"dtype": "float32", "shape": [1]}}

    def make_env(self, task, seed, episode):
        env = LineEnv(task, seed, episode, self.limit, self.image_size)
        self.opened.append(env)
        return env

    def expert_policy(self, task):
        raise ValueError("no expert")

    def close(self):
        pass


class ConstantPolicy:
    """Always the same action; remembers the reset calls."""

    def __init__(self, value: float, fail_on_episode: int | None = None) -> None:
        self.value, self.fail_on_episode, self.resets = value, fail_on_episode, []

    def reset(self, task, seed):
        self.resets.append((task, seed))

    def act(self, obs):
        if self.fail_on_episode is not None and len(self.resets) > self.fail_on_episode:
            raise RuntimeError("policy crashed")
        return np.array([self.value], dtype=np.float32)
