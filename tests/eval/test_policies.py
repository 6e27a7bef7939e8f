"""The random reference policy, the floor every report reads a trained policy against, on the real suites (PushT,
MetaWorld, LIBERO): it covers each suite's whole action box (per dimension, uniformly, dimensions independent),
never repeats itself, and is reproducible from the episode's seed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.helpers import require

os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo is imported: CPU rendering through Mesa's llvmpipe

from embodyhpc.eval.policies import RandomPolicy  # noqa: E402
from embodyhpc.eval.references import make_reference_policies, reference_policy_names  # noqa: E402
from embodyhpc.eval.suites import episode_seed, make_suite  # noqa: E402

pytestmark = pytest.mark.sim  # steps a simulator

SUITES = {"pusht": ("gym_pusht", "sim", "pusht"), "metaworld": ("metaworld", "sim", "reach-v3"),
          "libero": ("libero.libero", "libero", "libero_spatial/0")}
NUM_ACTIONS = 4000
NUM_BINS = 10


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.slow) if name == "libero" else name  # ~6 s to build
                        for name in sorted(SUITES)], scope="module")
def suite_task(request):
    module, extra, task = SUITES[request.param]
    require(module, extra)
    with make_suite(request.param, [task]) as suite:
        yield suite, task


def actions(suite, task, seed, n=NUM_ACTIONS):
    policy = make_reference_policies(reference_policy_names(), suite)["random"]
    assert isinstance(policy, RandomPolicy)
    policy.reset(task, seed)
    return np.stack([policy.act({}) for _ in range(n)])


def assert_uniform_in_box(samples, low, high, what):
    """Every value inside [low, high]; per dimension the ends reached, each tenth of the range hit about equally
    often, mean and spread those of a uniform law; dimensions uncorrelated."""
    span = high - low
    assert np.all(samples >= low) and np.all(samples <= high), what
    n = len(samples)
    for d in range(samples.shape[1]):
        x = (samples[:, d] - low[d]) / span[d]  # in [0, 1]
        assert x.min() < 0.02 and x.max() > 0.98, f"{what}: dim {d} spans [{x.min():.3f}, {x.max():.3f}] of its box"
        counts = np.histogram(x, bins=NUM_BINS, range=(0, 1))[0]
        assert counts.min() > 0.6 * n / NUM_BINS and counts.max() < 1.4 * n / NUM_BINS, f"{what}: dim {d} {counts}"
        assert abs(x.mean() - 0.5) < 0.03, f"{what}: dim {d} mean {x.mean():.3f}"
        assert abs(x.std() - 12 ** -0.5) < 0.02, f"{what}: dim {d} std {x.std():.3f}"
    if samples.shape[1] > 1:
        corr = np.corrcoef(samples, rowvar=False)
        off_diagonal = corr[~np.eye(len(corr), dtype=bool)]
        assert np.abs(off_diagonal).max() < 0.1, f"{what}: dimensions move together ({off_diagonal.round(2)})"


def test_random_actions_cover_the_action_box(suite_task):
    suite, task = suite_task
    low, high = (np.asarray(b, dtype=np.float64) for b in suite.action_bounds(task))
    samples = actions(suite, task, episode_seed(task, 0, 0))
    env = suite.make_env(task, 0, 0)
    try:
        assert samples.dtype == np.float32 and samples.shape == (NUM_ACTIONS, env.action_dim)
        env.reset()
        for action in samples[:3]:  # the suite takes them as they are
            env.step(action)
    finally:
        env.close()
    assert_uniform_in_box(samples.astype(np.float64), low, high, f"{suite.name} within one episode")


def test_random_first_actions_cover_the_box_across_episodes(suite_task):
    """Each episode reseeds: the first action of 1000 episodes is spread over the box too (a policy seeded once
    per process, or one whose first action is fixed, fails here)."""
    suite, task = suite_task
    low, high = (np.asarray(b, dtype=np.float64) for b in suite.action_bounds(task))
    firsts = np.stack([actions(suite, task, episode_seed(task, 0, e), n=1)[0] for e in range(1000)])
    span = high - low
    x = (firsts - low) / span
    assert np.all((x >= 0) & (x <= 1))
    for d in range(x.shape[1]):
        counts = np.histogram(x[:, d], bins=5, range=(0, 1))[0]
        assert counts.min() > 120, f"dim {d}: {counts}"  # 200 expected per fifth


def test_random_actions_never_repeat(suite_task):
    suite, task = suite_task
    samples = actions(suite, task, 11, n=500)
    assert np.all(np.any(samples[1:] != samples[:-1], axis=1))  # no action equal to the one before it
    assert len(np.unique(samples, axis=0)) == len(samples)


def test_random_actions_are_reproducible_from_the_seed(suite_task):
    suite, task = suite_task
    seed = episode_seed(task, 3, 7)
    first, again = actions(suite, task, seed, n=50), actions(suite, task, seed, n=50)
    np.testing.assert_array_equal(first, again)
    other = actions(suite, task, episode_seed(task, 3, 8), n=50)
    assert not np.any(np.all(first == other, axis=1))  # another episode: other actions at every step
    # one policy object reused across episodes (as run_shard does) gives each episode its own sequence again
    policy = RandomPolicy(suite)
    policy.reset(task, episode_seed(task, 3, 8))
    [policy.act({}) for _ in range(20)]
    policy.reset(task, seed)
    np.testing.assert_array_equal(np.stack([policy.act({}) for _ in range(50)]), first)


def test_random_policy_needs_reset_first(suite_task):
    suite, _ = suite_task
    with pytest.raises(RuntimeError, match="reset"):
        RandomPolicy(suite).act({})
