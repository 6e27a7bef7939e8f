"""What the RL roles exchange, as data: one policy decision (`ChunkSample`), the end of an episode (`EpisodeEnd`),
the policy version counter and the staleness gate the actor admits samples through.

Numpy only (no torch): env workers import this without torch, and the codec (embodyhpc.rl.codec) turns these into
messages without pickle.

Versions: the actor's policy version is the number of optimizer steps it has taken (0: the initial weights); every
sample carries the version of the weights that produced it. The actor admits a sample at most `max_staleness`
versions older than its own (`admit`); rollout workers only ever hold weights the actor sent, so a sample newer than
the actor is a mix-up of runs or of counters and is refused loudly rather than admitted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class ChunkSample:
    """One policy decision: the observation it was taken from, the denoising trajectory sampled and its behaviour
    log-probability, the version of the policy that produced it; `reward` and `done` once its episode is over
    (success 0/1 on the episode's last chunk, 0 elsewhere)."""

    env_id: int
    episode_id: int
    group_id: int  # GRPO: the initial state (task, seed, episode) the group's rollouts share
    chunk_index: int  # position of this chunk in its episode (0, 1, ...)
    observation: dict[str, Any]  # the raw observation: images uint8, state float32, "task" text
    trajectory: np.ndarray  # [K+1, H, A] float32: x_0 = noise ... x_K = the action chunk
    log_prob: np.ndarray  # [K, H, A] float32: per entry, per denoising step (behaviour policy)
    version: int
    reward: float = 0.0
    done: bool = False

    def __post_init__(self) -> None:
        self.trajectory = np.asarray(self.trajectory, dtype=np.float32)
        self.log_prob = np.asarray(self.log_prob, dtype=np.float32)
        if self.trajectory.ndim != 3 or self.log_prob.ndim != 3:
            raise ValueError(f"ChunkSample: trajectory must be [K+1,H,A] and log_prob [K,H,A], got "
                             f"{self.trajectory.shape} and {self.log_prob.shape}")
        k1, h, a = self.trajectory.shape
        if self.log_prob.shape != (k1 - 1, h, a) or k1 < 2:
            raise ValueError(f"ChunkSample: log_prob {self.log_prob.shape} does not match trajectory "
                             f"{self.trajectory.shape} (expected ({k1 - 1}, {h}, {a}), K >= 1)")
        for name in ("env_id", "episode_id", "group_id", "chunk_index", "version"):
            _check_count(f"ChunkSample.{name}", getattr(self, name))

    @property
    def actions(self) -> np.ndarray:
        """The action chunk the environment executed: the trajectory's last denoising state [H, A]."""
        return self.trajectory[-1]


@dataclass(frozen=True)
class EpisodeEnd:
    """An episode is over: who ran it, how it went, and the version of the policy that chose its last chunk."""

    env_id: int
    episode_id: int
    group_id: int
    success: bool
    episode_return: float
    length: int  # environment steps
    version: int  # of its last chunk

    def __post_init__(self) -> None:
        for name in ("env_id", "episode_id", "group_id", "length", "version"):
            _check_count(f"EpisodeEnd.{name}", getattr(self, name))
        if not math.isfinite(float(self.episode_return)):
            raise ValueError(f"EpisodeEnd.episode_return must be finite, got {self.episode_return!r}")


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _check_version(name: str, value: object) -> int:
    _check_count(name, value)
    return int(value)  # type: ignore[arg-type]


def staleness(sample_version: int, actor_version: int) -> int:
    """How many versions the sample's policy is behind the actor's (0: produced by the actor's current weights).
    A sample newer than the actor cannot come from this run's weights: ValueError naming both."""
    sample_version = _check_version("sample version", sample_version)
    actor_version = _check_version("actor version", actor_version)
    if sample_version > actor_version:
        raise ValueError(f"a sample of policy version {sample_version} reached the actor at version {actor_version}: "
                         "rollout and actor counters disagree (a sample from another run, or a resume that lost its "
                         "version counter)")
    return actor_version - sample_version


def admit(sample_version: int, actor_version: int, max_staleness: int) -> bool:
    """True when the sample is at most `max_staleness` versions older than the actor's policy (0: only samples of
    the current weights, the synchronous case)."""
    max_staleness = _check_version("max_staleness", max_staleness)
    return staleness(sample_version, actor_version) <= max_staleness


@dataclass
class StalenessGate:
    """The actor's admission of samples: `admit(...)` decides and counts; `metrics()` gives the MLflow values:
    rl/admitted, rl/rejected_stale, rl/rejected_stale_fraction, rl/staleness_mean and rl/staleness_max. Staleness
    is measured over every sample that reached the gate (admitted or not: how far behind the rollouts run);
    `reset()` starts a new window (e.g. one per logged step)."""

    max_staleness: int
    admitted: int = 0
    rejected: int = 0
    _staleness_sum: int = field(default=0, repr=False)
    _staleness_max: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.max_staleness = _check_version("max_staleness", self.max_staleness)

    def admit(self, sample_version: int, actor_version: int) -> bool:
        lag = staleness(sample_version, actor_version)
        self._staleness_sum += lag
        self._staleness_max = max(self._staleness_max, lag)
        ok = lag <= self.max_staleness
        if ok:
            self.admitted += 1
        else:
            self.rejected += 1
        return ok

    @property
    def seen(self) -> int:
        return self.admitted + self.rejected

    def metrics(self) -> dict[str, float]:
        seen = self.seen
        return {"rl/admitted": float(self.admitted), "rl/rejected_stale": float(self.rejected),
                "rl/rejected_stale_fraction": self.rejected / seen if seen else 0.0,
                "rl/staleness_mean": self._staleness_sum / seen if seen else 0.0,
                "rl/staleness_max": float(self._staleness_max)}

    def reset(self) -> None:
        self.admitted = self.rejected = self._staleness_sum = self._staleness_max = 0


class VersionCounter:
    """The policy version: monotonic, saved and restored as a plain int (`int(counter)`, `VersionCounter(saved)`),
    so a resumed run continues its counter. Going back is refused (ValueError): a stale checkpoint restored over a
    newer counter would make the actor admit samples of weights it no longer has."""

    def __init__(self, start: int = 0) -> None:
        self._value = _check_version("policy version", start)

    @property
    def value(self) -> int:
        return self._value

    def __int__(self) -> int:
        return self._value

    def __repr__(self) -> str:
        return f"VersionCounter({self._value})"

    def advance(self) -> int:
        """One optimizer step done: the next version."""
        self._value += 1
        return self._value

    def set(self, version: int) -> int:
        """Move to `version` (a received weight version, a restored counter); never backwards."""
        version = _check_version("policy version", version)
        if version < self._value:
            raise ValueError(f"policy version may not go back from {self._value} to {version}")
        self._value = version
        return version
