"""The pusht suite: gym-pusht's PushT behind the suite interface."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.helpers import require

os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo is imported: CPU rendering through Mesa's llvmpipe

from embodyhpc.eval.policies import ExpertPolicy, RandomPolicy  # noqa: E402
from embodyhpc.eval.references import make_reference_policies, reference_policy_names  # noqa: E402
from embodyhpc.eval.rollout import run_episode  # noqa: E402
from embodyhpc.eval.shards import Episode  # noqa: E402
from embodyhpc.eval.suite_pusht import MAX_STEPS  # noqa: E402
from embodyhpc.eval.suites import episode_seed, make_suite  # noqa: E402

pytestmark = pytest.mark.sim  # steps a simulator

require("gym_pusht", "sim")


def test_pusht_reset_step_and_random_episode():
    with pytest.raises(ValueError, match="no scripted expert"):
        ExpertPolicy(make_suite("pusht", ["pusht"]))
    suite = make_suite("pusht", ["pusht"], cameras=["top"], image_size=64)
    assert suite.tasks == ["pusht"] and not suite.has_expert
    assert list(make_reference_policies(reference_policy_names(), suite)) == ["random"]
    env = suite.make_env("pusht", 0, 2)
    obs = env.reset()
    shapes = {k: (v.dtype, v.shape) for k, v in obs.items() if k != "task"}
    assert shapes == {"observation.state": (np.float32, (2,)), "observation.environment_state": (np.float32, (5,)),
                      "observation.images.top": (np.uint8, (64, 64, 3))}
    assert {k: (v["dtype"], tuple(v["shape"])) for k, v in suite.features("pusht").items()} == {
        k: (str(d), s) for k, (d, s) in shapes.items()}
    obs2, reward, success, done = env.step(np.array([256.0, 256.0]))
    assert obs2.keys() == obs.keys() and isinstance(reward, float) and isinstance(success, bool)
    np.testing.assert_array_equal(env.reset()["observation.environment_state"], obs["observation.environment_state"])
    assert env.render().dtype == np.uint8
    env.close()

    from gym_pusht.envs import PushTEnv

    plain = PushTEnv(obs_type="state")
    state, _ = plain.reset(seed=episode_seed("pusht", 0, 2))
    np.testing.assert_allclose(obs["observation.environment_state"], state.astype(np.float32), atol=1e-4)

    state_suite = make_suite("pusht", ["PushT-v0"])
    env = state_suite.make_env("pusht", 0, 0)
    record = run_episode(env, RandomPolicy(state_suite), Episode("pusht", 0, 0),
                         max_steps=state_suite.max_steps("pusht"))
    env.close()
    assert record["length"] == 300 or record["success"]
    assert 0 <= record["return"] <= record["length"]


GOAL = (256.0, 256.0, np.pi / 4)  # gym-pusht's goal pose of the T (x, y, angle): PushTEnv._setup


def place(env, agent_xy, block_pose):
    """Put the simulator behind a suite env in a chosen state through gym-pusht's own `reset_to_state`.

    gym-pusht sets the block's position before its angle, and the angle turns the block about its centre of
    gravity, so the pose it lands in is offset from the one given; the offset depends on the angle only, so one
    probe finds the input that lands on `block_pose`. Returns the landed (x, y, angle)."""
    sim = env._env  # the gym-pusht PushTEnv the suite drives
    x, y, angle = block_pose
    _, info = sim.reset(options={"reset_to_state": [*agent_xy, x, y, angle]})
    landed = np.asarray(info["block_pose"][:2], dtype=np.float64)
    target = np.array([x, y]) * 2 - landed
    _, info = sim.reset(options={"reset_to_state": [*agent_xy, *target, angle]})
    np.testing.assert_allclose(info["block_pose"][:2], [x, y], atol=1e-6)
    return info["block_pose"]


AGENT_AWAY = (60.0, 60.0)  # a corner far from the T: holding still there pushes nothing

# (block pose, success): the goal pose and the same pose written differently succeed; small and large misses fail
POSES = [
    pytest.param(GOAL, True, id="at-goal"),
    pytest.param((GOAL[0], GOAL[1], GOAL[2] + 2 * np.pi), True, id="at-goal-angle+2pi"),
    pytest.param((GOAL[0] + 0.5, GOAL[1] - 0.5, GOAL[2]), True, id="half-pixel-off"),
    pytest.param((GOAL[0] + 3, GOAL[1], GOAL[2]), False, id="3px-off-92pct-covered"),
    pytest.param((GOAL[0], GOAL[1] + 8, GOAL[2]), False, id="8px-off"),
    pytest.param((GOAL[0], GOAL[1], GOAL[2] + 0.1), False, id="turned-0.1rad"),
    pytest.param((GOAL[0], GOAL[1], GOAL[2] + np.pi), False, id="upside-down-on-goal"),
    pytest.param((400.0, 120.0, 0.0), False, id="far"),
    pytest.param((120.0, 400.0, -2.0), False, id="far-other-side"),
]


@pytest.mark.parametrize(("pose", "expected"), POSES)
def test_pusht_success_flag_follows_the_block_pose(pose, expected):
    """The suite's success (and done: PushT ends at success) against states known to succeed and to fail."""
    env = make_suite("pusht", ["pusht"]).make_env("pusht", 0, 0)
    env.reset()
    place(env, AGENT_AWAY, pose)
    obs, reward, success, done = env.step(np.array(AGENT_AWAY))
    env.close()
    assert (success, done) == (expected, expected)
    np.testing.assert_allclose(obs["observation.environment_state"][2:4], pose[:2], atol=1e-3)  # nothing moved it
    assert (reward == 1.0) if expected else (reward < 1.0)


@pytest.mark.parametrize("episode", range(5))
def test_pusht_start_states_are_not_successes(episode):
    env = make_suite("pusht", ["pusht"]).make_env("pusht", 0, episode)
    obs = env.reset()
    _, _, success, done = env.step(obs["observation.state"].astype(np.float64))  # hold the agent still
    env.close()
    assert not success and not done


class HoldStill:
    """Commands the agent's current position: the block moves only if the agent already touches it."""

    def reset(self, task, seed):
        pass

    def act(self, obs):
        return obs["observation.state"].astype(np.float32)


@pytest.mark.parametrize(("pose", "expected_success", "expected_length"), [
    pytest.param(GOAL, True, 1, id="starts-at-goal"), pytest.param((400.0, 120.0, 0.0), False, MAX_STEPS, id="far")])
def test_pusht_rollout_records_success_from_the_simulator(monkeypatch, pose, expected_success, expected_length):
    """run_episode on the real suite: an episode that starts on the goal is a success at step 1; one far from it
    runs to PushT's 300-step limit and fails."""
    from embodyhpc.eval import suite_pusht

    original = suite_pusht.PushTEvalEnv.reset

    def reset_to_pose(self):
        original(self)
        place(self, AGENT_AWAY, pose)
        return self._obs(self._env.get_obs(), self._env._get_info())

    monkeypatch.setattr(suite_pusht.PushTEvalEnv, "reset", reset_to_pose)
    suite = make_suite("pusht", ["pusht"])
    env = suite.make_env("pusht", 0, 0)
    record = run_episode(env, HoldStill(), Episode("pusht", 0, 0), max_steps=suite.max_steps("pusht"))
    env.close()
    assert (record["success"], record["length"]) == (expected_success, expected_length)
    assert record["success_step"] == (1 if expected_success else None)
