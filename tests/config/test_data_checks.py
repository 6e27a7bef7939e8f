"""What a DataLoader worker would refuse hours into a job, refused at validate (validation/data_checks.py, the models'
check_dataset): the action chunk against model.action_horizon, the dataset's features, fps and episode lengths; the
prompt budget against the state, the cameras and the longest task; the warm-up against train.steps; a dataset whose
metadata cannot be read. Each refusal is one line with the key, the layer and the fix (exit 2); what would only be
cut or padded is a warning. The prompt-budget bound is checked against the collate itself: the value validate asks
for is the smallest the worst-case state fits in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import one_line_error, require

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "lerobot_v30_sample"  # 4 x 30 frames, 10 fps
CHUNK4 = "{action: [0.0, 0.1, 0.2, 0.3]}"


@pytest.fixture
def recipe(tmp_path) -> Path:
    """smoke_cpu training pi0.5 tiny on the LeRobot fixture (2 cameras, state 6, action 4), horizon 4: valid."""
    path = tmp_path / "recipe.yaml"
    path.write_text(f"base: smoke_cpu\ndata: {{format: lerobot, root: {FIXTURE}, delta_timestamps: {CHUNK4}}}\n"
                    "model: {action_horizon: 4, action_dim: 8}\neval: {execute_steps: 4}\n")
    return path


def _ok(result) -> list[str]:
    assert result.code == 0, result.err
    return [line for line in result.err.splitlines() if line.startswith("warning:")]


def test_the_valid_recipe_passes_without_warnings(cli, recipe):
    assert _ok(cli("validate", str(recipe))) == []


# ---- the action chunk, the dataset's features, fps and episodes ----
CHUNK_CASES = {
    "horizon above the chunk": (["model.action_horizon=5", "eval.execute_steps=5"],
                                ["data.delta_timestamps.action", "asks for an action chunk of 4 steps, the model "
                                 "predicts 5 (model.action_horizon=5)", "[i / fps for i in range(5)]"]),
    "horizon below the chunk": (["model.action_horizon=3", "eval.execute_steps=3"],
                                ["data.delta_timestamps.action", "chunk of 4 steps, the model predicts 3"]),
    "off the frame grid": (["data.delta_timestamps={action: [0.0, 0.1, 0.2, 0.35]}"],
                           ["data.delta_timestamps.action", "[0.35] s are not multiples of 1/fps = 0.1 s",
                            "10 fps", "fix: set data.delta_timestamps.action to [0.0, 0.1, 0.2, 0.3]"]),
    "unknown feature": (["data.delta_timestamps={action: [0.0, 0.1, 0.2, 0.3], observation.depth: [0.0]}"],
                        ["data.delta_timestamps.observation.depth", "unknown feature 'observation.depth'",
                         "observation.images.top"]),
    "chunk longer than every episode": (
        ["model.action_horizon=31", "eval.execute_steps=4",
         "data.delta_timestamps={action: [" + ", ".join(f"{i / 10}" for i in range(31)) + "]}"],
        ["data.delta_timestamps.action", "reaches 30 frames", "longest episode of the dataset has 30 frames",
         "model.action_horizon=31", "within 29 frames of its sample"]),
    "history longer than every episode": (
        ["data.delta_timestamps={action: [-3.0, -2.0, -1.0, 0.0]}"],
        ["data.delta_timestamps.action", "reaches 30 frames"]),
    "a state key the dataset lacks": (["model.state_key=observation.joints"],
                                      ["model.state_key", "the dataset has no 'observation.joints'",
                                       "observation.state"]),
}


@pytest.mark.parametrize("case", sorted(CHUNK_CASES))
def test_chunk_and_feature_mismatches_are_refused_naming_the_key_and_layer(cli, recipe, case):
    overrides, fragments = CHUNK_CASES[case]
    # the layer named is the one that set the key at fault: the recipe file for a chunk the new horizon outgrew
    layer = str(recipe) if case.startswith("horizon") else "override '"
    one_line_error(cli("validate", str(recipe), *overrides), layer, *fragments)


def test_a_mismatch_set_in_the_recipe_file_names_the_file(cli, recipe):
    recipe.write_text(recipe.read_text().replace("action_horizon: 4", "action_horizon: 6"))
    one_line_error(cli("validate", str(recipe), "eval.execute_steps=4"), str(recipe),
                   "data.delta_timestamps.action", "model predicts 6")


def test_a_recipe_without_an_action_chunk_is_refused(cli, recipe):
    recipe.write_text(recipe.read_text().replace(f"delta_timestamps: {CHUNK4}", "delta_timestamps: {}"))
    one_line_error(cli("validate", str(recipe)), "data.delta_timestamps",
                   "no action chunk requested: the model predicts 4 steps", "range(4)")


@pytest.fixture(scope="module")
def uneven_hdf5(tmp_path_factory) -> Path:
    """Two demos of 10 and 40 steps (20 fps), a camera, a 3-dim state, 2-dim actions, a long instruction."""
    h5py = require("h5py", "data")
    path = tmp_path_factory.mktemp("uneven") / "demos.hdf5"
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["problem_info"] = json.dumps({"language_instruction": "pick up the red block " * 6})
        for name, length in (("demo_0", 10), ("demo_1", 40)):
            demo = data.create_group(name)
            demo.create_dataset("obs/agentview_rgb", data=np.zeros((length, 8, 8, 3), dtype=np.uint8))
            demo.create_dataset("obs/state", data=np.zeros((length, 3)))
            demo.create_dataset("actions", data=np.zeros((length, 2)))
    return path


def _chunk(horizon: int, fps: int) -> str:
    return "data.delta_timestamps={action: [" + ", ".join(str(i / fps) for i in range(horizon)) + "]}"


def test_a_chunk_longer_than_the_shortest_episode_only_warns(cli, recipe, uneven_hdf5):
    warnings = _ok(cli("validate", str(recipe), "data.format=hdf5", f"data.root={uneven_hdf5}", _chunk(15, 20),
                       "model.action_horizon=15", "eval.execute_steps=4", "model.max_token_len=256"))
    assert any("model.action_horizon=15: the action chunk reaches 14 frames and the shortest episode has 10" in w
               for w in warnings), warnings
    one_line_error(cli("validate", str(recipe), "data.format=hdf5", f"data.root={uneven_hdf5}", _chunk(41, 20),
                       "model.action_horizon=41", "eval.execute_steps=4"),
                   "model.action_horizon", "longest episode of the dataset has 40 frames")


# ---- the prompt budget (pi0.5), the cameras, state and action widths (pi0.5, GR00T) ----
def test_too_small_a_prompt_budget_for_the_state_is_refused_with_the_value_that_fits(cli, recipe):
    line = one_line_error(cli("validate", str(recipe), "model.max_token_len=60"), "model.max_token_len",
                          "the prompt without its instruction takes up to 49 tokens", "6-dim state",
                          "leaves 24 after 2 camera(s) and 4 actions", "model.state_input=expert")
    assert "set model.max_token_len=85 or more" in line
    assert _ok(cli("validate", str(recipe), "model.max_token_len=85")) != []  # fits; the tasks are cut (warned)


def test_the_budget_validate_asks_for_is_exactly_what_the_collate_needs(recipe):
    """The worst-case state (every dimension at the top of its range: bin 255) through the real collate."""
    import torch

    from embodyhpc.config.schema import ModelConfig
    from embodyhpc.data import open_dataset
    from embodyhpc.errors import ConfigError
    from embodyhpc.models import build_tokenizer
    from embodyhpc.models.pi05.batching import Pi05Collate

    item = open_dataset(FIXTURE, {"action": [0.0, 0.1, 0.2, 0.3]})[0]
    item = {**item, "observation.state": torch.ones(6), "task": ""}
    for max_token_len, fits in ((85, True), (84, False)):
        cfg = ModelConfig(size="tiny", action_horizon=4, action_dim=8, max_token_len=max_token_len, packing=False)
        collate = Pi05Collate(cfg, build_tokenizer(cfg))
        if fits:
            collate([item])
        else:
            with pytest.raises(ConfigError, match="cannot hold"):
                collate([item])


PROMPT_CASES = {
    "no room left after the images": (["model.max_token_len=40"],
                                      ["model.max_token_len", "leaves 4 prompt tokens after 2 camera(s) x 16 patches"]),
    "expert state wider than state_dim": (["model.state_input=expert", "model.state_dim=4"],
                                          ["model.state_dim", "'observation.state' has 6 dims, the model reads 4",
                                           "set model.state_dim=6"]),
    "groot: no room for the instruction": (["model.name=groot", "model.max_token_len=36"],
                                           ["model.max_token_len", "leaves 4 instruction tokens"]),
    "groot: more action dims than action_dim": (["model.name=groot", "model.action_dim=2"],
                                                ["model.action_dim", "4 action dims, more than model.action_dim=2"]),
}


@pytest.mark.parametrize("case", sorted(PROMPT_CASES))
def test_model_fit_refusals(cli, recipe, case):
    overrides, fragments = PROMPT_CASES[case]
    one_line_error(cli("validate", str(recipe), *overrides), *fragments)


def test_cut_tasks_and_trimmed_actions_are_warnings(cli, recipe, uneven_hdf5):
    warnings = _ok(cli("validate", str(recipe), "model.max_token_len=90", "model.action_dim=2"))
    assert any("model.max_token_len=90: the longest task ('open the drawer') makes a" in w for w in warnings), warnings
    assert any("model.action_dim=2: the dataset has 4 action dims" in w for w in warnings), warnings
    warnings = _ok(cli("validate", str(recipe), "model.name=groot", "model.max_token_len=60", "data.format=hdf5",
                       f"data.root={uneven_hdf5}", _chunk(4, 20)))
    assert any("the longest task ('pick up the red block" in w and "its end is cut" in w for w in warnings), warnings


def test_a_groot_state_wider_than_its_encoder_is_refused(cli, recipe, tmp_path):
    h5py = require("h5py", "data")
    path = tmp_path / "wide.hdf5"
    with h5py.File(path, "w") as f:
        demo = f.create_group("data").create_group("demo_0")
        demo.create_dataset("obs/agentview_rgb", data=np.zeros((20, 8, 8, 3), dtype=np.uint8))
        demo.create_dataset("obs/state", data=np.zeros((20, 80)))
        demo.create_dataset("actions", data=np.zeros((20, 2)))
    one_line_error(cli("validate", str(recipe), "model.name=groot", "data.format=hdf5", f"data.root={path}",
                       _chunk(4, 20)), "model.state_key", "80 dims, GR00T's state encoder reads at most 64")


# ---- the schedule, an unreadable dataset, what cannot be checked from here ----
@pytest.mark.parametrize("steps", ["train.steps=20", "train.steps=19", "train.steps=1"])
def test_steps_at_or_below_the_warmup_are_refused(cli, recipe, steps):
    one_line_error(cli("validate", str(recipe), steps, "train.warmup_steps=20"), "train.warmup_steps", "train.steps")


def test_the_stand_in_has_no_schedule_to_refuse(cli):
    assert _ok(cli("validate", "smoke_cpu", "train.steps=2")) == []  # warm-up 20: the synthetic loop does not care


def test_an_unreadable_dataset_is_refused_naming_the_file(cli, recipe, tmp_path):
    garbage = tmp_path / "demos.hdf5"
    garbage.write_bytes(b"\x89HDF-not-really" * 100)
    one_line_error(cli("validate", str(recipe), "data.format=hdf5", f"data.root={garbage}"), "data.root",
                   str(garbage), "cannot open as HDF5")
    broken = tmp_path / "lerobot"
    shutil.copytree(FIXTURE, broken)
    episodes = broken / "meta" / "episodes" / "chunk-000" / "file-000.parquet"
    episodes.chmod(0o644)
    episodes.write_bytes(episodes.read_bytes()[:1000])
    one_line_error(cli("validate", str(recipe), f"data.root={broken}"), "data.root", str(episodes))


def test_a_dataset_on_a_filesystem_not_mounted_here_is_left_to_the_job(cli, recipe):
    warnings = _ok(cli("validate", str(recipe), "data.root=/nonexistent-mount/datasets/demo",
                       "model.max_token_len=40"))  # too small, but the cameras are unknown here
    assert any("not visible from this machine" in w for w in warnings), warnings
    one_line_error(cli("validate", str(recipe), "data.root=/nonexistent-mount/datasets/demo",
                       "model.action_horizon=5", "eval.execute_steps=5"), "data.delta_timestamps.action")
