"""The suite registry and what every suite shares."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo is imported: CPU rendering through Mesa's llvmpipe

from embodyhpc.eval.suites import (  # noqa: E402
    EvalEnv,
    Suite,
    available_suites,
    episode_seed,
    make_suite,
    register_suite,
)
from tests.eval.fake_suite import LineSuite  # noqa: E402


def test_registry_and_lazy_imports():
    assert {"metaworld", "pusht"} <= set(available_suites())
    with pytest.raises(ValueError, match="unknown evaluation suite 'nope'"):
        make_suite("nope", ["x"])
    with pytest.raises(ValueError, match="already registered"):
        register_suite("metaworld", lambda *a, **k: None)
    # the report job and the CLI import these without torch or any simulator
    code = ("import sys; import embodyhpc.eval.suites, embodyhpc.eval.aggregate, embodyhpc.eval.rollout, "
            "embodyhpc.eval.policies, embodyhpc.eval.plots, embodyhpc.eval.shards; "
            "print(sorted(m for m in ('torch', 'mujoco', 'metaworld', 'gym_pusht', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_episode_seed_is_a_pure_function():
    assert episode_seed("a", 0, 1) == episode_seed("a", 0, 1)
    seeds = {episode_seed("a", 0, 1), episode_seed("a", 0, 2), episode_seed("a", 1, 1), episode_seed("b", 0, 1)}
    assert len(seeds) == 4
    with pytest.raises(ValueError):
        episode_seed("a", -1, 0)




def test_a_site_registers_its_own_suite():
    register_suite("line-test", LineSuite, replace=True)
    suite = make_suite("line-test", ["walk"], image_size=8)
    assert isinstance(suite, Suite) and isinstance(suite.make_env("walk", 0, 0), EvalEnv)
    assert "line-test" in available_suites()
