"""Split an evaluation (tasks x seeds x episodes) into array shards.

Episodes are listed in (episode, seed, task) order and dealt to the shards in rounds of `num_shards`; each round
starts one shard further on than the last. So shard sizes differ by at most one and every shard gets a mix of
tasks even when the number of tasks is a multiple of the number of shards (plain round-robin would then give each
shard a single task): a slow task does not pile up on one shard. The plan depends on its arguments only.
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
    shards: list[list[Episode]] = [[] for _ in range(num_shards)]
    for i, episode in enumerate(all_episodes(tasks, seeds, episodes_per_task)):
        shards[(i + i // num_shards) % num_shards].append(episode)
    return shards


def shard_of(plan: list[list[Episode]]) -> dict[Episode, int]:
    """{episode: shard index} of a plan (to name the shard an episode's missing record belongs to)."""
    return {episode: shard for shard, episodes in enumerate(plan) for episode in episodes}
