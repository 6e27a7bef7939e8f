"""The static task lists `validate` checks eval.tasks against, and the cameras and action sizes `eval --ckpt` checks
a policy against, are the simulators' own."""

from __future__ import annotations

import pytest

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


def test_metaworld_cameras_and_action_size_are_a_task_model_s():
    """`eval --ckpt` refuses a policy camera outside METAWORLD_CAMERAS: it must be exactly what a task's MuJoCo
    model holds (the suite renders any of them; all fifty tasks: the slow test below)."""
    import mujoco

    from embodyhpc.sim import metaworld as mw

    env = mw.make_env("door-open-v3", 0, 0)
    names = {mujoco.mj_id2name(env.model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(env.model.ncam)}
    assert names == set(task_names.METAWORLD_CAMERAS)
    assert env.action_space.shape == (task_names.SUITE_ACTION_DIMS["metaworld"],)


@pytest.mark.slow
def test_metaworld_cameras_hold_for_all_fifty_tasks():
    import mujoco

    from embodyhpc.sim import metaworld as mw

    for task in mw.known_tasks():
        model = mw.make_env(task, 0, 0).model
        names = {mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)}
        assert names == set(task_names.METAWORLD_CAMERAS), task


def test_pusht_and_libero_cameras_and_action_sizes_are_the_suites():
    from embodyhpc.eval import suite_libero

    assert task_names.SUITE_CAMERAS["pusht"] == (suite_pusht.CAMERA,)
    assert set(task_names.SUITE_CAMERAS["libero"]) == set(suite_libero.CAMERAS)
    assert task_names.SUITE_ACTION_DIMS["libero"] == suite_libero.ACTION_DIM
    with suite_pusht.PushTSuite(["pusht"]) as suite:
        env = suite.make_env("pusht", 0, 0)
        assert env.action_dim == task_names.SUITE_ACTION_DIMS["pusht"]
        env.close()


def test_a_suite_nobody_registered_says_nothing():
    assert task_names.suite_cameras("no-such-suite") is None and task_names.suite_action_dim("no-such-suite") is None
