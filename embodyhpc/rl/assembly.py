"""What the actor keeps between the stream and its losses: pieces assembled into episodes and whole groups
(`Assembler`, actor rank 0), and what one version's step measured (`Window`, its metrics)."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch

from embodyhpc.rl.codec import episode_end_from, sample_from
from embodyhpc.rl.critic import explained_variance
from embodyhpc.rl.samples import ChunkSample, EpisodeEnd


@dataclass
class Episode:
    samples: dict[int, ChunkSample] = field(default_factory=dict)
    end: EpisodeEnd | None = None
    env_s: float = 0.0
    push_wait_s: float = 0.0  # its rollout worker's time blocked on the actor's full queue (reported with its samples)


class Assembler:
    """Rank 0: streamed pieces -> episodes -> whole groups (GRPO needs every rollout of an initial state)."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.episodes: dict[int, Episode] = defaultdict(Episode)
        self.groups: dict[int, set[int]] = defaultdict(set)
        self.finished: set[int] = set()
        self.restarted = 0
        self.times = defaultdict(float)

    def take(self, message: Any) -> None:
        if message.kind == "chunk_sample":
            sample = sample_from(message)
            if sample.episode_id in self.finished:
                return
            episode = self.episodes[sample.episode_id]
            if sample.chunk_index in episode.samples or (sample.chunk_index == 0 and episode.samples):
                self.restarted += 1  # its env worker died and the episode runs again from its start: drop the old
                episode.samples.clear()
            episode.samples[sample.chunk_index] = sample
            self.times["rollout_s"] += float(message.fields.get("infer_s", 0.0))
            episode.push_wait_s += float(message.fields.get("push_wait_s", 0.0))
        elif message.kind == "episode_end":
            end = episode_end_from(message)
            if end.episode_id in self.finished:
                return
            episode = self.episodes[end.episode_id]
            episode.end, episode.env_s = end, float(message.fields.get("env_s", 0.0))
            self.finished.add(end.episode_id)
            self.groups[end.group_id].add(end.episode_id)
            self.times["env_s"] += episode.env_s
            self.times["env_steps"] += end.length

    def complete_groups(self) -> list[list[Episode]]:
        """Groups whose every rollout ended, removed from the assembler (GRPO: rl.group_size each)."""
        out = []
        for group_id in [g for g, eps in self.groups.items() if len(eps) >= self.group_size]:
            ids = sorted(self.groups.pop(group_id))
            out.append([self.episodes.pop(i) for i in ids])
        return out


class Window:
    """What one version's step measured (rank 0's metrics)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.times: dict[str, float] = defaultdict(float)
        self.episodes = 0
        self.successes = 0
        self.returns = 0.0
        self.lengths = 0
        self.samples = 0
        self.zero_advantage = 0
        self.value_pairs: list[tuple[float, float]] = []  # PPO: (return, value the advantage used) per trained sample
        self.out_of_range = 0  # PPO: trained samples with a normalised state entry beyond critic.OUT_OF_RANGE
        self.loss: dict[str, float] = {}
        self._loss_sums: dict[str, float] = defaultdict(float)
        self._loss_n = 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def add_episodes(self, group: list[Episode]) -> None:
        for episode in group:
            self.times["push_wait_s"] += episode.push_wait_s  # MLflow time/push_wait_s: back-pressure on the rollouts
            self.episodes += 1
            self.successes += int(episode.end.success)
            self.returns += float(episode.end.episode_return)
            self.lengths += int(episode.end.length)

    def add_loss(self, stats: dict[str, float], n: int) -> None:
        if n:
            for key, value in stats.items():
                self._loss_sums[key] += value * n
            self._loss_n += n

    def add_values(self, samples: list[ChunkSample], out_of_range: int = 0) -> None:
        """PPO: the GAE return and the critic's value (before this step's update) of each sample trained, and how many
        of them had a normalised state entry out of range."""
        self.value_pairs += [(float(s.observation["_return"]), float(s.observation["_value"])) for s in samples]
        self.out_of_range += out_of_range

    def metrics(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        elapsed = self.elapsed()
        out = {"env/episodes": float(self.episodes)}
        if self.episodes:  # a step trained on samples left from earlier groups: no episode ended in it
            out.update({"env/success_once": self.successes / n, "env/return": self.returns / n,
                        "env/episode_length": self.lengths / n})
        out |= {"rl/samples_per_s": self.samples / max(elapsed, 1e-9), "rl/samples": float(self.samples),
                "rl/zero_advantage_samples": float(self.zero_advantage), "time/step_s": elapsed}
        out.update({f"time/{k}": v for k, v in self.times.items()})
        out.update({k: v / max(self._loss_n, 1) for k, v in self._loss_sums.items()})
        if self.value_pairs:  # PPO: the version's samples' 1 - Var(returns - values) / Var(returns)
            pairs = torch.tensor(self.value_pairs, dtype=torch.float64)
            explained = explained_variance(pairs[:, 0], pairs[:, 1])
            if explained is not None:
                out["rl/explained_variance"] = explained
            out["rl/state_out_of_range"] = self.out_of_range / len(self.value_pairs)
        out.update(self.loss)
        return out
