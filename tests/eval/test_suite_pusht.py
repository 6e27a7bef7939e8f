"""The pusht suite: gym-pusht's PushT behind the suite interface."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.helpers import require

os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo is imported: CPU rendering through Mesa's llvmpipe

from embodyhpc.eval.policies import ExpertPolicy, RandomPolicy, reference_policies  # noqa: E402
from embodyhpc.eval.rollout import run_episode  # noqa: E402
from embodyhpc.eval.shards import Episode  # noqa: E402
from embodyhpc.eval.suites import episode_seed, make_suite  # noqa: E402

require("gym_pusht", "sim")


def test_pusht_reset_step_and_random_episode():
    with pytest.raises(ValueError, match="no scripted expert"):
        ExpertPolicy(make_suite("pusht", ["pusht"]))
    suite = make_suite("pusht", ["pusht"], cameras=["top"], image_size=64)
    assert suite.tasks == ["pusht"] and not suite.has_expert and list(reference_policies(suite)) == ["random"]
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
