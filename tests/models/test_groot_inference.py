"""GrootRunner, the spec's evaluation policy: receding-horizon chunks, per-env noise, observations fed as in
training."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodyhpc.data.normalize import StateNormalizer
from embodyhpc.models import build_model
from embodyhpc.models.groot.inference import GrootRunner
from embodyhpc.validation import load_recipe


@pytest.fixture(scope="module")
def runner_parts():
    config = load_recipe("recipes/demo_groot_metaworld_cpu.yaml").config
    torch.manual_seed(0)
    return build_model(config.model), config


def runner(parts, execute_steps: int = 8) -> GrootRunner:
    model, config = parts
    return GrootRunner(model, config, normalizer=StateNormalizer(config.model.state_key, "none"),
                       execute_steps=execute_steps, denoise_steps=4, num_action_dims=4)


def obs(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"observation.images.corner": rng.integers(0, 255, (48, 48, 3), dtype=np.uint8),
            "observation.environment_state": rng.standard_normal(39).astype(np.float32), "task": "reach the goal"}


def test_it_executes_a_chunk_then_replans(runner_parts):
    policy = runner(runner_parts)
    policy.reset("reach-v3", seed=7)
    actions = [policy.act(obs(i)) for i in range(9)]
    assert all(a.shape == (4,) and a.dtype == np.float32 for a in actions)
    assert policy.chunks_predicted == 2  # steps 0 and 8 read an observation
    again = runner(runner_parts)
    again.reset("reach-v3", seed=7)
    assert all(np.array_equal(a, again.act(obs(i))) for i, a in enumerate(actions))


def test_an_env_gets_the_same_chunk_alone_or_batched(runner_parts):
    alone, batched = runner(runner_parts), runner(runner_parts)
    alone.reset("reach-v3", seed=11, env=1)
    for env, seed in ((0, 3), (1, 11)):
        batched.reset("reach-v3", seed=seed, env=env)
    solo = alone.act_batch([obs(5)], [1])[0]
    pair = batched.act_batch([obs(4), obs(5)], [0, 1])
    np.testing.assert_allclose(pair[1], solo, rtol=1e-5, atol=1e-5)
    assert not np.allclose(pair[0], pair[1])


def test_refusals(runner_parts):
    policy = runner(runner_parts)
    with pytest.raises(RuntimeError, match=r"call reset\(task, seed, env=0\)"):
        policy.act(obs(0))
    policy.reset("reach-v3", seed=0)
    bad = obs(0)
    del bad["observation.environment_state"]
    with pytest.raises(KeyError, match="the policy was trained on 'observation.environment_state'"):
        policy.act(bad)
    with pytest.raises(ValueError, match=r"execute_steps=17 must be in \[1, model.action_horizon=16\]"):
        runner(runner_parts, execute_steps=17)
