"""The static task lists `validate` checks eval.tasks against are the simulators' own."""

from __future__ import annotations

from embodyhpc.eval import suite_pusht, task_names


def test_metaworld_list_matches_metaworld():
    from embodyhpc.sim import metaworld as mw

    assert sorted(task_names.METAWORLD_TASKS) == sorted(mw.known_tasks())
    assert set(mw.MT10_TASKS) <= set(task_names.METAWORLD_TASKS)


def test_pusht_list_matches_the_suite():
    assert set(task_names.PUSHT_TASKS) == set(suite_pusht.ALIASES)


def test_every_listed_task_passes_and_a_neighbour_does_not():
    assert task_names.unknown_task("metaworld", [*task_names.METAWORLD_TASKS, "MT10", "mt50"]) is None
    assert task_names.unknown_task("metaworld", ["reach-v2"])[0] == "reach-v2"
    assert task_names.unknown_task("pusht", ["PUSHT"]) is None
    assert task_names.unknown_task("a-site-suite", ["anything"]) is None  # registered suites check their own


def test_libero_counts_match_the_benchmarks():
    from embodyhpc.eval.suite_libero import expand_tasks

    for bench, count in task_names.LIBERO_BENCHMARKS.items():
        assert len(expand_tasks([bench])) == count
    assert len(expand_tasks(["libero"])) == 40


def test_libero_tasks_are_checked_at_validate():
    ok = ["libero", "libero_spatial", "LIBERO_GOAL/9", "libero_90/89", "libero_spatial/pick_up_the_black_bowl"]
    assert task_names.unknown_task("libero", ok) is None
    for bad in ("libero_100", "libero_spatial/10", "libero_90/90", "libero_goal/", "libero/3", "spatial/0", ""):
        assert task_names.unknown_task("libero", ["libero_10", bad])[0] == bad
