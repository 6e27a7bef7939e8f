"""MetaWorld's success is its own info["success"] of the step just taken: a success on the last allowed step counts,
in the evaluation suite and in the demo generator's expert rollouts (tests/eval/test_success_timing.py has the other
suites)."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from tests.helpers import require

os.environ.setdefault("MUJOCO_GL", "egl")

from embodyhpc.eval.rollout import run_episode  # noqa: E402
from embodyhpc.eval.shards import Episode  # noqa: E402
from embodyhpc.eval.suites import make_suite  # noqa: E402
from tests.eval.test_success_timing import Replay  # noqa: E402

pytestmark = pytest.mark.sim  # steps a simulator

require("metaworld", "sim")
from embodyhpc.sim import metaworld as mw  # noqa: E402


def test_metaworld_success_on_the_last_allowed_step_counts():
    """MetaWorld's own env and expert, stepped here, find the step k whose info["success"] is the first True. The
    same actions in our suite with max_steps=k give a success at step k, with max_steps=k-1 none; so do the demo
    generator's expert rollouts (embodyhpc.sim.metaworld.rollout_expert) with k and k-1 steps."""
    task, seed, episode = "reach-v3", 0, 2
    spec = mw.episode_spec(task, seed, episode)
    env, expert = mw.make_env(spec.env_name, spec.env_seed, spec.env_variant), mw.make_expert(task)
    obs, _ = env.reset()
    actions, first = [], None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Constant\\(s\\) may be too high")  # the experts' gain warning
        for step in range(1, 200):
            action = np.clip(expert.get_action(obs), env.action_space.low, env.action_space.high)
            obs, _, _, _, info = env.step(action)
            actions.append(action)
            if info["success"]:
                first = step
                break
    assert first is not None and first > 2
    for limit in (first, first - 1):
        frames, success = mw.rollout_expert(env, expert, max_steps=limit)
        assert (success, len(frames["action"]), frames["next.success"][-1]) == (limit == first, limit, limit == first)
        assert not frames["next.success"][:-1].any()
    env.close()

    with make_suite("metaworld", [task]) as suite:
        for limit, expected in ((first, (True, first, first)), (first - 1, (False, first - 1, None))):
            ours = suite.make_env(task, seed, episode)
            record = run_episode(ours, Replay(actions), Episode(task, seed, episode), max_steps=limit)
            ours.close()
            got = (record["success"], record["length"], record["success_step"])
            assert got == expected, f"max_steps={limit}: (success, length, success_step) {got} != {expected}"
