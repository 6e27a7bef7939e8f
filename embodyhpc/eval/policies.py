"""Policies for evaluation: the protocol a trained model's adapter implements, and the reference policies.

    policy.reset(task, seed)     # before every episode; seed = episode_seed(task, seed, episode)
    action = policy.act(obs)     # obs: the suite's observation dict; action: float32 (action_dim,)

Reference rows in every report (so a success rate can be read against the floor and the ceiling):
- ExpertPolicy: the suite's scripted experts (`suite.expert_policy(task)`: MetaWorld's metaworld.policies, which
  read "observation.environment_state"; each gets a copy, as some experts edit the array they are given).
  Suites without an expert (pusht) say so with `has_expert = False`; eval/references.py then leaves it out.
- RandomPolicy: uniform in the action bounds, seeded per episode (the same episode, the same actions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from embodyhpc.eval.suites import Obs, Suite


@runtime_checkable
class Policy(Protocol):
    def reset(self, task: str, seed: int) -> None: ...

    def act(self, obs: Obs) -> np.ndarray: ...


class ExpertPolicy:
    """The suite's scripted expert of each task (built once per task), clipped to the action bounds."""

    def __init__(self, suite: Suite) -> None:
        if not suite.has_expert:
            raise ValueError(f"the {suite.name} suite has no scripted expert")
        self._suite = suite
        self._experts: dict[str, Callable[[Obs], np.ndarray]] = {}
        self._task: str | None = None

    def reset(self, task: str, seed: int) -> None:
        if task not in self._experts:
            self._experts[task] = self._suite.expert_policy(task)
        self._task = task
        self._low, self._high = self._suite.action_bounds(task)

    def act(self, obs: Obs) -> np.ndarray:
        if self._task is None:
            raise RuntimeError("call reset(task, seed) before act()")
        action = np.asarray(self._experts[self._task](obs), dtype=np.float32)
        return np.clip(action, self._low, self._high).astype(np.float32)


class RandomPolicy:
    """Actions uniform in the task's action bounds; `reset(task, seed)` reseeds (reproducible per episode)."""

    def __init__(self, suite: Suite) -> None:
        self._suite = suite
        self._rng: np.random.Generator | None = None

    def reset(self, task: str, seed: int) -> None:
        low, high = self._suite.action_bounds(task)
        self._low, self._span = np.asarray(low, dtype=np.float32), np.asarray(high - low, dtype=np.float32)
        self._rng = np.random.default_rng(seed)

    def act(self, obs: Obs) -> np.ndarray:
        if self._rng is None:
            raise RuntimeError("call reset(task, seed) before act()")
        return self._low + self._span * self._rng.random(self._low.shape, dtype=np.float32)


__all__ = ["ExpertPolicy", "Policy", "RandomPolicy"]
