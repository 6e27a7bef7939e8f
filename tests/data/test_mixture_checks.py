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


def test_a_prompt_of_states_padded_to_model_state_dim_is_counted_at_validate(datasets, tmp_path):
    """pi0.5 with model.state_input=prompt writes a mixture's states zero-padded to model.state_dim into the prompt
    (models/pi05/batching.py). Reference: the training collate itself, on real samples of the mixture."""
    from embodyhpc.config.schema import ModelConfig
    from embodyhpc.data.mixture_open import mixture_normalizer, open_mixture
    from embodyhpc.models import build_tokenizer
    from embodyhpc.models.pi05.batching import Pi05Collate
    from tests.data.test_mixture import mixture_config, pyav

    data = mixture_config({name: datasets[name] for name in ROBOTS})
    items = open_mixture(data, seed=0, open_one=pyav).__getitems__(list(range(4)))
    norm = mixture_normalizer(data, "observation.state", "mean_std")
    prompt = ("model.state_input=prompt", "model.max_token_len=128")
    for state_dim, fits in ((6, True), (40, False)):  # the datasets' states: 4 and 6 dims
        cfg = ModelConfig(name="pi05", size="tiny", action_horizon=4, action_dim=4, state_dim=state_dim,
                          state_input="prompt", max_token_len=128)
        try:
            Pi05Collate(cfg, build_tokenizer(cfg), norm)(items)
            collated = True
        except ConfigError:
            collated = False
        assert collated is fits, state_dim
        if fits:
            check(PI05, datasets, ["a", "b"], tmp_path, *prompt, f"model.state_dim={state_dim}")
            continue
        with pytest.raises(ConfigError) as info:
            check(PI05, datasets, ["a", "b"], tmp_path, *prompt, f"model.state_dim={state_dim}")
        text = str(info.value)
        assert info.value.key == "model.max_token_len" and "\n" not in text, text
        assert "data.datasets[0]" in text and "model.state_dim=40" in text


def test_an_unknown_embodiment_is_refused_at_validate(datasets, tmp_path):
    entries = f"[{{root: {datasets['a']}, weight: 3, embodiment: gr1}}, {{root: {datasets['b']}, embodiment: gr2}}]"
    overrides = ["data.root=null", f"data.datasets={entries}", f"job.runs_root={tmp_path}",
                 "data.delta_timestamps={action: [0.0, 0.1, 0.2, 0.3]}", "model.action_horizon=4",
                 "eval.execute_steps=4", "model.state_key=observation.state"]
    with pytest.raises(ConfigError) as info:
        check_paths(load_recipe(GROOT, overrides))
    text = str(info.value)
    assert info.value.key == "data.datasets[1].embodiment" and info.value.exit_code == 2 and "\n" not in text
    assert "'gr2'" in text and all(name in text for name in ("new_embodiment", "gr1", "agibot_genie1", "oxe_droid"))
    check_paths(load_recipe(GROOT, [o.replace("gr2", "17") for o in overrides]))  # an id is fine


def test_one_statistics_file_for_a_mixture_is_refused_not_ignored(datasets, tmp_path):
    """model.norm_stats is checked against data.root (validation/paths.py); a mixture reads each dataset's own
    statistics, so a file (or init's) named there would be silently unused."""
    from embodyhpc.data.normalize import StateNormalizer

    StateNormalizer.from_dataset(str(datasets["a"]), "observation.state", "mean_std").save(tmp_path)
    stats = next(tmp_path.glob("*.json"))
    with pytest.raises(ConfigError) as info:
        check(GROOT, datasets, ["a", "b"], tmp_path, f"model.norm_stats={stats}")
    assert info.value.key == "model.norm_stats" and "\n" not in str(info.value) and "mixture" in str(info.value)
    assert check(GROOT, datasets, ["a", "b"], tmp_path, "model.norm_stats=dataset") == []
