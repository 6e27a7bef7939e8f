"""Validate-time checks of what a mixture mixes (validation/mixture_checks.py): each bad mix is one line naming the
dataset (index and root) and the key; a good one passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from embodyhpc.errors import ConfigError
from embodyhpc.validation import load_recipe
from embodyhpc.validation.paths import check_paths
from tests.data.test_mixture import ROBOTS, write_robot

GROOT = "recipes/demo_groot_metaworld_cpu.yaml"
PI05 = "recipes/demo_metaworld_cpu.yaml"


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("mixture_checks")
    made = {name: write_robot(base / name, r["state"], r["action"], r["scale"], r["offset"], seed=n, episodes=1)
            for n, (name, r) in enumerate(ROBOTS.items())}
    made["wrist"] = write_robot(base / "wrist", 4, 4, 1.0, 0.0, seed=5, episodes=1, camera="wrist")
    made["fast"] = write_robot(base / "fast", 4, 4, 1.0, 0.0, seed=6, episodes=1, fps=15)
    made["wide"] = write_robot(base / "wide", 8, 7, 1.0, 0.0, seed=7, episodes=1)
    return made


def check(recipe: str, datasets: dict[str, Path], names: list[str], tmp_path, *extra: str) -> list[str]:
    entries = ", ".join(f"{{root: {datasets[n]}, weight: {i + 1}}}" for i, n in enumerate(names))
    loaded = load_recipe(recipe, ["data.root=null", f"data.datasets=[{entries}]", f"job.runs_root={tmp_path}",
                                  "data.delta_timestamps={action: [0.0, 0.1, 0.2, 0.3]}", "model.action_horizon=4",
                                  "eval.execute_steps=4", "model.state_key=observation.state", *extra])
    return check_paths(loaded)


def test_a_good_mix_passes(datasets, tmp_path):
    assert check(GROOT, datasets, ["a", "b"], tmp_path) == []


@pytest.mark.parametrize(("recipe", "names", "extra", "key", "fragment"), [
    (GROOT, ["a", "wrist"], (), "data.datasets[1].root", "cameras"),
    (PI05, ["a", "wide"], ("model.action_dim=4",), "data.datasets[1].root", "7 action dims"),
    (PI05, ["a", "b"], ("model.state_input=prompt", "model.state_dim=5"), "data.datasets[1].root", "6 dims"),
    (PI05, ["a", "b"], ("model.state_input=expert", "model.state_dim=5"), "model.state_dim", "6 dims"),
    (GROOT, ["a", "fast"], (), "data.delta_timestamps.action", "data.datasets[1]"),
])
def test_a_bad_mix_is_one_line_naming_the_dataset_and_key(datasets, tmp_path, recipe, names, extra, key, fragment):
    with pytest.raises(ConfigError) as info:
        check(recipe, datasets, names, tmp_path, *extra)
    text = str(info.value)
    assert info.value.key == key and fragment in text and "\n" not in text
    bad = names[1]
    assert f"data.datasets[1] ({datasets[bad]})" in text


def test_relative_mixture_roots_are_made_absolute_from_where_one_submits(datasets, tmp_path, monkeypatch):
    """Jobs start elsewhere: like data.root, each data.datasets[i].root relative to the submitting directory is
    absolute in the config every job reads."""
    from embodyhpc.submit import absolute_paths

    recipe = str(Path(GROOT).resolve())
    monkeypatch.chdir(datasets["a"].parent)
    entries = f"[{{root: {datasets['a'].name}, weight: 3}}, {{root: {datasets['b']}}}]"
    loaded = load_recipe(recipe, ["data.root=null", f"job.runs_root={tmp_path}",
                                                      f"data.datasets={entries}"])
    roots = [e.root for e in absolute_paths(loaded).config.data.datasets]
    assert roots == [str(datasets["a"].resolve()), str(datasets["b"])]
