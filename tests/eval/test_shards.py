from __future__ import annotations

import pytest

from embodyhpc.eval.shards import all_episodes, plan_shards


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


def test_plan_is_deterministic_and_rejects_zero_shards():
    assert plan_shards(["a", "b"], [0], 5, 3) == plan_shards(["a", "b"], [0], 5, 3)
    with pytest.raises(ValueError):
        plan_shards(["a"], [0], 1, 0)
