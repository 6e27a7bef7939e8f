from __future__ import annotations

import random
from collections import Counter

import pytest

from embodyhpc.eval.shards import Episode, all_episodes, plan_shards, shard_of


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7, 13, 60])
@pytest.mark.parametrize(("tasks", "seeds", "episodes"), [
    (["a"], [0], 60), (["a", "b", "c"], [0, 1], 10), ([f"t{i}" for i in range(10)], [5, 6, 7], 2)])
def test_every_episode_exactly_once(tasks, seeds, episodes, num_shards):
    shards = plan_shards(tasks, seeds, episodes, num_shards)
    assert len(shards) == num_shards
    flat = [e for shard in shards for e in shard]
    assert sorted(flat) == sorted(all_episodes(tasks, seeds, episodes))
    assert len(set(flat)) == len(tasks) * len(seeds) * episodes
    sizes = [len(s) for s in shards]
    assert max(sizes) - min(sizes) <= 1


def test_every_episode_exactly_once_for_any_shard_count():
    """Property test: random grids, every shard count from 1 to past the number of episodes."""
    rng = random.Random(1234)
    for _ in range(25):
        tasks = [f"task-{i}" for i in range(rng.randint(1, 6))]
        seeds = rng.sample(range(1000), rng.randint(1, 4))
        episodes = rng.randint(1, 12)
        grid = {Episode(t, s, e) for t in tasks for s in seeds for e in range(episodes)}
        for num_shards in range(1, len(grid) + 3):
            shards = plan_shards(tasks, seeds, episodes, num_shards)
            counts = Counter(e for shard in shards for e in shard)
            assert set(counts) == grid and set(counts.values()) == {1}, (tasks, seeds, episodes, num_shards)
            sizes = [len(s) for s in shards]
            assert len(sizes) == num_shards and max(sizes) - min(sizes) <= 1


def test_shards_mix_tasks():
    shards = plan_shards(["a", "b", "c"], [0], 4, 3)
    assert all(len({e.task for e in shard}) == 3 for shard in shards)


def test_plan_is_deterministic_and_rejects_zero_shards():
    assert plan_shards(["a", "b"], [0], 5, 3) == plan_shards(["a", "b"], [0], 5, 3)
    with pytest.raises(ValueError):
        plan_shards(["a"], [0], 1, 0)


def test_shard_of_inverts_the_plan():
    plan = plan_shards(["a", "b"], [0, 1], 3, 5)
    owner = shard_of(plan)
    assert len(owner) == 12 and all(episode in plan[owner[episode]] for episode in owner)
