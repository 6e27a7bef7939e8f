"""Split an evaluation (tasks x seeds x episodes) into array shards.

Episodes are dealt round-robin in (episode, seed, task) order, so every shard gets a mix of
tasks and shard sizes differ by at most one: a slow task does not pile up on one shard.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Episode:
    task: str
    seed: int
    episode: int


def all_episodes(tasks: list[str], seeds: list[int], episodes_per_task: int) -> list[Episode]:
    return [Episode(task, seed, ep) for ep in range(episodes_per_task) for seed in seeds for task in tasks]


def plan_shards(tasks: list[str], seeds: list[int], episodes_per_task: int,
                num_shards: int) -> list[list[Episode]]:
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    episodes = all_episodes(tasks, seeds, episodes_per_task)
    return [episodes[i::num_shards] for i in range(num_shards)]
