"""Wilson intervals against the formula written out here, and aggregation of known records against a plan."""

from __future__ import annotations

import json
import math

import pytest

from embodyhpc.eval.aggregate import aggregate, format_table, load_records, markdown_summary, wilson_interval
from embodyhpc.eval.shards import Episode, all_episodes, plan_shards


def wilson_by_hand(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    # (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), written independently of the module
    p = k / n
    a = p + z**2 / (2 * n)
    b = z * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    c = 1 + z**2 / n
    return (a - b) / c, (a + b) / c


@pytest.mark.parametrize(("k", "n"), [(0, 10), (5, 10), (10, 10), (1, 1), (0, 1), (8, 10), (3, 50), (49, 50)])
def test_wilson_matches_the_formula(k, n):
    low, high = wilson_interval(k, n)
    expected_low, expected_high = wilson_by_hand(k, n)
    assert low == pytest.approx(max(0.0, expected_low), abs=1e-12)
    assert high == pytest.approx(min(1.0, expected_high), abs=1e-12)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_wilson_known_values_and_edges():
    # textbook values: 0/10 -> [0, 0.2775], 5/10 -> [0.2366, 0.7634], 10/10 -> [0.7225, 1]
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)  # nothing recorded: nothing known
    narrow, wide = wilson_interval(50, 100, z=1.0), wilson_interval(50, 100, z=2.576)
    assert wide[0] < narrow[0] < 0.5 < narrow[1] < wide[1]
    for bad in [(-1, 10), (11, 10), (0, -1)]:
        with pytest.raises(ValueError):
            wilson_interval(*bad)


def record(policy, task, seed, episode, success, ret=1.0, length=10):
    return {"policy": policy, "task": task, "seed": seed, "episode": episode, "success": success, "return": ret,
            "length": length}


def write_shards(tmp_path, plan, outcome, policy="trained", skip=()):
    for index, shard in enumerate(plan):
        if index in skip:
            continue
        lines = [json.dumps(record(policy, e.task, e.seed, e.episode, *outcome(e))) for e in shard]
        (tmp_path / f"shard-{index:04d}.jsonl").write_text("\n".join(lines) + "\n")


def test_known_records_give_known_rates(tmp_path):
    tasks = ["reach-v3", "push-v3"]
    plan = plan_shards(tasks, [0], 10, 3)
    # reach succeeds on episodes 0-7 (8/10), push on episodes 0-1 (2/10); return = episode, length = 10 + episode
    write_shards(tmp_path, plan, lambda e: ((e.episode < 8) if e.task == "reach-v3" else (e.episode < 2),
                                             float(e.episode), 10 + e.episode))
    (tmp_path / "shard-0009.jsonl.tmp").write_text("not json: an unfinished shard must not be read\n")
    report = aggregate(load_records(tmp_path), all_episodes(tasks, [0], 10))
    assert list(report.policies) == ["trained"] and report.complete
    trained = report.policies["trained"]
    reach, push = trained.tasks["reach-v3"], trained.tasks["push-v3"]
    assert (reach.planned, reach.recorded, reach.successes, reach.success_rate) == (10, 10, 8, 0.8)
    assert (reach.ci_low, reach.ci_high) == pytest.approx(wilson_by_hand(8, 10))
    assert push.success_rate == 0.2 and (push.ci_low, push.ci_high) == pytest.approx(wilson_by_hand(2, 10))
    assert reach.mean_return == pytest.approx(4.5) and reach.mean_length == pytest.approx(14.5)
    assert trained.overall.success_rate == 0.5 and trained.overall.recorded == 20
    assert (trained.overall.ci_low, trained.overall.ci_high) == pytest.approx(wilson_by_hand(10, 20))
    assert trained.mean_task_success_rate == pytest.approx(0.5)
    table = format_table(report)
    assert "0.80 [0.49, 0.94]" in table and "0.20 [0.06, 0.51]" in table and "INCOMPLETE" not in table
    assert table.splitlines()[0].split() == ["task", "trained"]


def test_missing_shard_is_reported_not_averaged_away(tmp_path):
    tasks = ["a", "b"]
    plan = plan_shards(tasks, [0, 1], 5, 4)
    write_shards(tmp_path, plan, lambda e: (True,), skip={2})
    report = aggregate(load_records(tmp_path), all_episodes(tasks, [0, 1], 5))
    trained = report.policies["trained"]
    assert not report.complete and not trained.complete
    assert sorted(trained.missing) == sorted(plan[2])
    assert trained.overall.planned == 20 and trained.overall.recorded == 20 - len(plan[2])
    assert trained.overall.missing == len(plan[2])
    for task in tasks:
        stats = trained.tasks[task]
        assert stats.planned == 10 and stats.recorded == 10 - sum(e.task == task for e in plan[2])
        assert not stats.complete
    table = format_table(report)
    assert f"({trained.overall.recorded}/20)" in table and "INCOMPLETE trained" in table
    assert f"{len(plan[2])} of 20 planned episodes have no record" in table
    summary = markdown_summary(report, images={"per task": "task_success.png"})
    assert "**INCOMPLETE**" in summary and "![per task](task_success.png)" in summary
    assert report.to_dict()["complete"] is False
    assert len(report.to_dict()["policies"]["trained"]["missing"]) == len(plan[2])


def test_policies_grouped_with_reference_rows_and_odd_records():
    plan = all_episodes(["a"], [0], 4)
    records = [record("trained", "a", 0, e, e % 2 == 0) for e in range(4)]
    records += [record("expert", "a", 0, e, True) for e in range(4)]
    records += [record("random", "a", 0, e, False) for e in range(3)]  # one episode lost
    records += [record("expert", "a", 0, 0, False),  # duplicate: the first record counts
                record("expert", "a", 9, 0, True),  # not in the plan
                {"policy": "expert", "task": "a", "seed": 0, "episode": 1}]  # no outcome
    report = aggregate(records, plan, policies=["trained", "expert", "random", "never-ran"])
    assert list(report.policies) == ["trained", "expert", "random", "never-ran"]
    assert report.policies["trained"].overall.success_rate == 0.5
    expert = report.policies["expert"]
    assert expert.overall.success_rate == 1.0 and expert.complete
    assert (expert.duplicates, expert.unplanned, expert.invalid) == (1, 1, 1)
    assert report.policies["random"].missing == [Episode("a", 0, 3)]
    never = report.policies["never-ran"]
    assert never.overall.recorded == 0 and never.overall.success_rate is None and len(never.missing) == 4
    assert never.mean_task_success_rate is None
    table = format_table(report)
    header = table.splitlines()[0].split()
    assert header == ["task", "trained", "expert", "random", "never-ran"]
    assert "n/a (0/4)" in table and "0.00 [0.00, 0.56] (3/4)" in table
    assert "records duplicated were ignored" in table


def test_load_records_names_the_bad_line(tmp_path):
    path = tmp_path / "shard-0000.jsonl"
    path.write_text(json.dumps(record("p", "a", 0, 0, True)) + "\n{oops\n")
    with pytest.raises(ValueError, match="shard-0000.jsonl:2"):
        load_records(path)
