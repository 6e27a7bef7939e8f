"""An evaluation suite added from this folder alone, through the `embodyhpc.eval_suites` entry point group:
walk along a line to a goal. It has a scripted expert, so `embodyhpc data synth --env walk` records demonstrations
and reports get an expert row; `task_names` lets `validate` refuse an unknown task before anything runs.

Observations: observation.state float32 (2,) = (position, goal); actions (1,) in [-1, 1] move by a tenth of the
action per step; success when the position is within 0.05 of the goal.
"""

from __future__ import annotations

import numpy as np

GOALS = {"walk-near": 0.3, "walk-far": 0.8}


class WalkEnv:
    def __init__(self, task: str, seed: int, episode: int, limit: int, image_size: int) -> None:
        self.task, self.seed, self.episode = task, seed, episode
        self.action_dim, self.fps = 1, 10
        self.limit, self.image_size = limit, image_size
        self.goal = GOALS[task]

    def _obs(self) -> dict:
        return {"observation.state": np.array([self.position, self.goal], dtype=np.float32),
                "task": f"walk to {self.goal}"}

    def reset(self) -> dict:
        rng = np.random.default_rng([self.seed, self.episode])
        self.position, self.steps = float(rng.uniform(-1.0, 0.0)), 0
        return self._obs()

    def step(self, action):
        self.position += 0.1 * float(np.clip(np.asarray(action).reshape(-1)[0], -1, 1))
        self.steps += 1
        success = abs(self.position - self.goal) < 0.05
        return self._obs(), float(success), success, self.steps >= self.limit

    def render(self) -> np.ndarray:
        frame = np.zeros((self.image_size, self.image_size, 3), dtype=np.uint8)
        frame[:, : int(self.image_size * min(max((self.position + 1) / 2, 0), 1)), 1] = 255
        return frame

    def close(self) -> None:
        pass


class WalkSuite:
    name, has_expert = "walk", True
    task_names = tuple(GOALS)

    def __init__(self, tasks, *, cameras=(), image_size=16, limit=40) -> None:
        unknown = [t for t in tasks if t not in GOALS]
        if unknown:
            raise ValueError(f"unknown walk task {unknown[0]!r}")
        if cameras:
            raise ValueError("the walk suite has no cameras")
        self.tasks, self.cameras, self.image_size, self.limit = list(tasks), (), image_size, limit

    def instruction(self, task: str) -> str:
        return f"walk to {GOALS[task]}"

    def max_steps(self, task: str) -> int:
        return self.limit

    def action_bounds(self, task: str):
        return np.array([-1.0], dtype=np.float32), np.array([1.0], dtype=np.float32)

    def features(self, task: str) -> dict:
        return {"observation.state": {"dtype": "float32", "shape": [2]}}

    def make_env(self, task: str, seed: int, episode: int) -> WalkEnv:
        return WalkEnv(task, seed, episode, self.limit, self.image_size)

    def expert_policy(self, task: str):
        def expert(obs):
            position, goal = obs["observation.state"]
            return np.array([np.clip((goal - position) * 10, -1, 1)], dtype=np.float32)

        return expert

    def close(self) -> None:
        pass

    def __enter__(self) -> WalkSuite:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
