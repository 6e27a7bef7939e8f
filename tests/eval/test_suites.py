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


def test_validate_asks_the_registry_which_suites_and_options_exist():
    from embodyhpc.errors import ConfigError
    from embodyhpc.validation import load_recipe

    libero = load_recipe("smoke_cpu", ["eval.shards=1", "eval.suite=libero", "eval.tasks=[libero_spatial]",
                                       "eval.suite_options.convention=openpi"]).config.eval
    assert libero.suite == "libero" and dict(libero.suite_options) == {"convention": "openpi"}
    with pytest.raises(ConfigError, match="eval.suite") as refused:
        load_recipe("smoke_cpu", ["eval.shards=1", "eval.suite=nope"])
    assert "libero" in str(refused.value)  # the choices come from the registry
    for bad in ("eval.suite_options.bogus=1", "eval.suite_options.cameras=[x]", "eval.suite_options.tasks=[x]"):
        with pytest.raises(ConfigError, match="eval.suite_options"):
            load_recipe("smoke_cpu", ["eval.shards=1", "eval.suite=libero", "eval.tasks=[libero_spatial]", bad])
    with pytest.raises(ConfigError, match="pusht suite has no option 'convention'"):
        load_recipe("smoke_cpu", ["eval.shards=1", "eval.suite=pusht", "eval.tasks=[pusht]",
                                  "eval.suite_options.convention=x"])
    register_suite("line-test", LineSuite, replace=True)  # a site's suite: accepted with its own options
    line = load_recipe("smoke_cpu", ["eval.shards=1", "eval.suite=line-test", "eval.tasks=[walk]",
                                     "eval.suite_options.limit=5"])
    assert line.config.eval.suite_options == {"limit": 5}


@pytest.mark.parametrize("name", ["metaworld", "pusht", "libero"])
def test_option_names_read_from_source_equal_the_signature(name):
    """validate reads a shipped suite's options from its source (no simulator, no numpy); the same as inspecting
    the imported class."""
    import importlib
    import inspect

    from embodyhpc.eval.suites import suite_option_names

    module, _, attr = {"metaworld": "embodyhpc.eval.suite_metaworld:MetaWorldSuite",
                       "pusht": "embodyhpc.eval.suite_pusht:PushTSuite",
                       "libero": "embodyhpc.eval.suite_libero:LiberoSuite"}[name].partition(":")
    init = getattr(importlib.import_module(module), attr).__init__
    imported = [p.name for p in inspect.signature(init).parameters.values()
                if p.kind is p.KEYWORD_ONLY and p.name not in ("cameras", "image_size")]
    assert suite_option_names(name) == imported and imported


def test_validating_a_recipe_imports_no_numpy():
    code = ("import sys; from embodyhpc.validation import load_recipe; "
            "load_recipe('smoke_cpu', ['eval.suite_options.video_size=32']); "
            "print(sorted(m for m in ('numpy', 'torch', 'metaworld') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
