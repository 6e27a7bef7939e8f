"""The metaworld suite resets like the demo generator and reads like its datasets; its experts succeed."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers import require

os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo is imported: CPU rendering through Mesa's llvmpipe

from embodyhpc.eval.policies import ExpertPolicy, RandomPolicy  # noqa: E402
from embodyhpc.eval.references import make_reference_policies, reference_policy_names  # noqa: E402
from embodyhpc.eval.rollout import run_episode  # noqa: E402
from embodyhpc.eval.shards import Episode  # noqa: E402
from embodyhpc.eval.suites import EvalEnv, Suite, make_suite  # noqa: E402

pytestmark = pytest.mark.sim  # steps a simulator

TASK = "reach-v3"
require("metaworld", "sim")
from embodyhpc.sim import metaworld as mw  # noqa: E402


@pytest.fixture(scope="module")
def state_suite():
    with make_suite("metaworld", [TASK]) as suite:
        yield suite


def test_metaworld_task_groups():
    suite = make_suite("metaworld", ["MT10", "reach-v3"])
    assert suite.tasks == list(mw.MT10_TASKS)  # duplicates dropped, order kept
    assert len(make_suite("metaworld", ["MT50"]).tasks) == 50
    assert isinstance(suite, Suite) and suite.has_expert
    assert suite.instruction("push-v3") == "push the puck to the goal" and suite.max_steps(TASK) == 500
    with pytest.raises(ValueError, match="unknown MetaWorld task"):
        make_suite("metaworld", ["reach-v2"])


def test_same_episode_same_initial_state_as_the_demo_generator(state_suite):
    first = state_suite.make_env(TASK, 0, 3)
    assert isinstance(first, EvalEnv) and first.action_dim == 4 and first.fps == 80
    obs = first.reset()
    first.close()
    # after other episodes of the same simulator (reused by the suite) and in a fresh suite: the same state
    for other in [(0, 4), (1, 3)]:
        env = state_suite.make_env(TASK, *other)
        assert not np.array_equal(env.reset()["observation.environment_state"], obs["observation.environment_state"])
        env.close()
    again = state_suite.make_env(TASK, 0, 3)
    np.testing.assert_array_equal(again.reset()["observation.environment_state"], obs["observation.environment_state"])
    again.close()
    with make_suite("metaworld", [TASK]) as fresh:
        env = fresh.make_env(TASK, 0, 3)
        np.testing.assert_array_equal(env.reset()["observation.environment_state"],
                                      obs["observation.environment_state"])
        env.close()
    spec = mw.episode_spec(TASK, 0, 3)
    demo_env = mw.make_env(spec.env_name, spec.env_seed, spec.env_variant)
    raw, _ = demo_env.reset()
    demo_env.close()
    np.testing.assert_array_equal(obs["observation.environment_state"], raw.astype(np.float32))
    np.testing.assert_array_equal(obs["observation.state"], raw[:4].astype(np.float32))
    assert obs["task"] == mw.instruction_for(TASK)


def test_expert_succeeds_and_random_rarely_does(state_suite):
    outcomes = {}
    for name, policy in make_reference_policies(reference_policy_names(), state_suite).items():
        records = []
        for e in range(5):
            env = state_suite.make_env(TASK, 100, e)
            try:
                records.append(run_episode(env, policy, Episode(TASK, 100, e), max_steps=state_suite.max_steps(TASK)))
            finally:
                env.close()
        outcomes[name] = records
    assert sum(r["success"] for r in outcomes["expert"]) >= 4
    assert all(r["length"] < 200 for r in outcomes["expert"] if r["success"])
    assert sum(r["success"] for r in outcomes["random"]) <= 1
    assert all(r["length"] == 500 for r in outcomes["random"] if not r["success"])


def test_random_policy_is_seeded_per_episode(state_suite):
    policy = RandomPolicy(state_suite)
    policy.reset(TASK, 7)
    first = [policy.act({}) for _ in range(3)]
    policy.reset(TASK, 7)
    assert all(np.array_equal(a, b) for a, b in zip(first, [policy.act({}) for _ in range(3)], strict=True))
    assert all(a.dtype == np.float32 and np.all(np.abs(a) <= 1) for a in first)


def test_expert_gets_a_copy_of_the_observation():
    # door-open-v3's expert shifts the handle position in the array it is given
    suite = make_suite("metaworld", ["door-open-v3"])
    policy = ExpertPolicy(suite)
    policy.reset("door-open-v3", 0)
    state = np.linspace(-0.3, 0.6, 39).astype(np.float32)
    before = state.copy()
    action = policy.act({"observation.environment_state": state})
    np.testing.assert_array_equal(state, before)
    assert action.shape == (4,) and action.dtype == np.float32


@pytest.mark.slow
def test_observations_match_the_demo_dataset(tmp_path):
    """Keys, shapes and dtypes of a camera suite's observations = the features generate_demos writes; the demos'
    first frame is the suite's initial state of the same (task, seed, episode)."""
    import pyarrow.parquet as pq

    root = tmp_path / "demos"
    mw.generate_demos(root, tasks=[TASK], episodes_per_task=1, seed=3, cameras=("corner",),
                                   image_size=64, max_steps=150, progress=False)
    features = json.loads((root / "meta/info.json").read_text())["features"]
    expected = {k: ("uint8" if v["dtype"] == "video" else v["dtype"], tuple(v["shape"]))
                for k, v in features.items() if k.startswith("observation.")}
    with make_suite("metaworld", [TASK], cameras=["corner"], image_size=64) as suite:
        env = suite.make_env(TASK, 3, 0)
        obs = env.reset()
        step_obs, *_ = env.step(np.zeros(4, dtype=np.float32))
        env.close()
        declared = {k: (v["dtype"], tuple(v["shape"])) for k, v in suite.features(TASK).items()}
    for o in (obs, step_obs):
        assert {k: (str(v.dtype), v.shape) for k, v in o.items() if k != "task"} == expected == declared
    assert obs["task"] == pq.read_table(root / "meta/tasks.parquet").to_pandas().index[0]
    first = pq.read_table(root / "data/chunk-000/file-000.parquet").to_pylist()[0]
    np.testing.assert_array_equal(obs["observation.environment_state"],
                                  np.asarray(first["observation.environment_state"], dtype=np.float32))
    assert obs["observation.images.corner"].std() > 5  # a rendered scene, not a blank buffer




@pytest.mark.parametrize("episode", range(3))
def test_reach_success_flag_follows_the_hand_to_goal_distance(state_suite, episode):
    """reach-v3 succeeds when the gripper is within 5 cm of the goal (MetaWorld's criterion). Along an expert run
    that goes on past success, the suite's flag is False at every step with the hand (observation[:3]; the
    gripper's centre is ~1.5 cm from it) farther than 8 cm from the goal (observation[-3:]) and True at every step
    closer than 2 cm; there are steps of both kinds."""
    policy = ExpertPolicy(state_suite)
    policy.reset(TASK, 0)
    env = state_suite.make_env(TASK, 0, episode)
    far, near = [], []
    try:
        obs = env.reset()
        for _ in range(150):
            obs, _, success, _ = env.step(policy.act(obs))
            state = obs["observation.environment_state"]
            distance = float(np.linalg.norm(state[:3] - state[-3:]))
            (far if distance > 0.08 else near if distance < 0.02 else []).append(success)
    finally:
        env.close()
    assert len(far) >= 5 and len(near) >= 5, (len(far), len(near))
    assert not any(far) and all(near)


def test_reach_success_is_not_reported_for_an_idle_hand(state_suite):
    """Holding still (zero action) from the start never reaches the goal: no step reports success."""
    env = state_suite.make_env(TASK, 0, 0)
    try:
        env.reset()
        flags = [env.step(np.zeros(4, dtype=np.float32))[2] for _ in range(50)]
    finally:
        env.close()
    assert not any(flags)
