"""`embodyhpc export --format lerobot`: an export in LeRobot's pi0.5 policy layout (config.json + model.safetensors),
read back through our published-weights adapter; the layout is the family's (its spec's lerobot_export), and a family
without one is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from embodyhpc.models import build_model
from embodyhpc.models.pi05.weights import load_pi05_weights
from embodyhpc.validation import load_recipe
from tests.exports import make_export

RECIPE = "recipes/demo_metaworld_cpu.yaml"


@pytest.fixture
def export(tmp_path):
    loaded = load_recipe(RECIPE, [f"data.root={tmp_path}", "model.state_input=prompt", "model.state_norm=quantile"])
    torch.manual_seed(3)
    model = build_model(loaded.config.model, loaded.config.precision)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not the init: a swapped or dropped tensor shows
    out = make_export(tmp_path / "export", model, config_yaml=loaded.to_yaml())
    (out / "policy_io.json").write_text(json.dumps({"cameras": ["corner"], "image_size": 32, "action_dim": 4,
                                                    "state_key": "observation.environment_state", "fps": 80}))
    return out, model, loaded.config.model


def test_the_lerobot_layout_reads_back_through_our_adapter(export, tmp_path):
    """The layout at a tiny size (strict=False: stock LeRobot builds only the full size, which the command refuses
    below), read back through our adapter."""
    from embodyhpc.checkpoint.lerobot_export import export_lerobot

    source, model, model_cfg = export
    export_lerobot(source, tmp_path / "lerobot", execute_steps=5, strict=False)
    weights = load_file(tmp_path / "lerobot" / "model.safetensors")
    assert weights and all(k.startswith("model.") for k in weights)  # LeRobot's policy prefix
    back = build_model(model_cfg)
    report = load_pi05_weights(back, tmp_path / "lerobot" / "model.safetensors")
    assert report.ok and report.key_prefix == "model."
    for name, value in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name
    config = json.loads((tmp_path / "lerobot" / "config.json").read_text())
    assert config["type"] == "pi05" and config["chunk_size"] == model_cfg.action_horizon == 10
    assert config["n_action_steps"] == 5 and config["max_action_dim"] == model_cfg.action_dim
    assert config["input_features"]["observation.images.corner"] == {"type": "VISUAL", "shape": [3, 32, 32]}
    assert config["output_features"] == {"action": {"type": "ACTION", "shape": [4]}}
    assert config["embodyhpc_size"] == "tiny"  # LeRobot's variants exist for the full size only


# LeRobot 0.4.4's pi0.5 processor pipelines (make_pi05_pre_post_processors in policies/pi05/processor_pi05.py): each
# step's registry name and the fields its dataclass takes, recorded from lerobot 0.4.4 (ProcessorStepRegistry and
# dataclasses.fields); LeRobot builds each step from its JSON config strictly
_NORMALIZER = {"features", "norm_map", "stats", "device", "dtype", "eps", "normalize_observation_keys"}
LEROBOT_044_PRE = [("rename_observations_processor", {"rename_map"}),
                   ("to_batch_processor", {"to_batch_action_processor", "to_batch_complementary_data_processor",
                                           "to_batch_observation_processor"}),
                   ("normalizer_processor", _NORMALIZER),
                   ("pi05_prepare_state_tokenizer_processor_step", {"max_state_dim", "task_key"}),
                   ("tokenizer_processor", {"tokenizer_name", "tokenizer", "max_length", "task_key",
                                            "padding_side", "padding", "truncation"}),
                   ("device_processor", {"device", "float_dtype"})]
LEROBOT_044_POST = [("unnormalizer_processor", _NORMALIZER), ("device_processor", {"device", "float_dtype"})]


def test_the_command_writes_only_what_stock_lerobot_loads(cli, export, tmp_path):
    """A tiny model (the demo's size) is refused in one line naming model.size and why, before anything is written
    (the demo model's state projection: test_refusals_are_one_line); the processor pipelines are LeRobot 0.4.4's,
    step by step, with only fields its steps take."""
    from embodyhpc.models.pi05.lerobot import write_processors

    source, _, _ = export
    tiny = cli("export", str(source), "--out", str(tmp_path / "lerobot"))
    assert tiny.code == 2 and len(tiny.err.strip().splitlines()) == 1, tiny.err
    assert "model.size=tiny" in tiny.err and "PI05Policy builds only" in tiny.err and "model.size=full" in tiny.err
    assert not (tmp_path / "lerobot").exists()
    config = {"input_features": {"observation.state": {"type": "STATE", "shape": [4]}},
              "output_features": {"action": {"type": "ACTION", "shape": [4]}}, "max_state_dim": 32,
              "tokenizer_max_length": 48, "normalization_mapping": {"STATE": "QUANTILES"}}
    write_processors(tmp_path, config, None)
    for name, recorded in (("policy_preprocessor", LEROBOT_044_PRE), ("policy_postprocessor", LEROBOT_044_POST)):
        steps = json.loads((tmp_path / f"{name}.json").read_text())["steps"]
        assert [s["registry_name"] for s in steps] == [n for n, _ in recorded], name
        for step, (step_name, fields) in zip(steps, recorded, strict=True):
            assert set(step["config"]) <= fields, (step_name, set(step["config"]) - fields)


def test_refusals_are_one_line(cli, export, tmp_path):
    source, _, _ = export
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in ("config.yaml", "export.json", "policy_io.json"):
        (damaged / name).write_bytes((source / name).read_bytes())
    (damaged / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes()[:-8])
    expert = tmp_path / "expert"
    loaded = load_recipe(RECIPE, [f"data.root={tmp_path}"])  # state_input: expert (a state projection)
    make_export(expert, build_model(loaded.config.model, loaded.config.precision), config_yaml=loaded.to_yaml())
    for args, message in (((str(source), "--out", str(taken)), "not empty"),
                          ((str(expert), "--out", str(tmp_path / "z")), "model.state_input=expert"),
                          ((str(source), "--out", str(tmp_path / "x"), "--format", "onnx"), "unknown format"),
                          ((str(source), "--out", str(tmp_path / "x"), "--execute-steps", "0"), ">= 1"),
                          ((str(damaged), "--out", str(tmp_path / "y")), "model.safetensors")):
        result = cli("export", *args)
        assert result.code == 2 and message in result.err and len(result.err.strip().splitlines()) == 1, result.err
    assert (taken / "keep.txt").read_text() == "mine" and not (tmp_path / "x").exists()


def test_the_lerobot_folder_carries_the_statistics_and_tokenizer_back_into_init_weights(export, tmp_path):
    """LeRobot's processor files hold the training statistics; a run starting from the folder reads them back (and
    the tokenizer copy), as from a LeRobot-saved policy."""
    from embodyhpc.config.schema import ModelConfig
    from embodyhpc.data.normalize import StateNormalizer
    from embodyhpc.models.checkpoint_assets import resolve_normalizer, resolve_tokenizer

    source, _, model_cfg = export
    trained = StateNormalizer("observation.state", "quantile", (0.5, -1.0, 2.0), (1.0, 0.25, 3.0))
    trained.save(source)
    (source / "tokenizer.model").write_bytes(b"not read here")
    from embodyhpc.checkpoint.lerobot_export import export_lerobot

    out = export_lerobot(source, tmp_path / "lerobot", strict=False)  # the tiny size: see above
    pre = json.loads((out / "policy_preprocessor.json").read_text())
    names = [s["registry_name"] for s in pre["steps"]]
    assert names[2] == "normalizer_processor" and names[-2] == "tokenizer_processor"
    assert pre["steps"][2]["config"]["norm_map"]["STATE"] == "QUANTILES"
    assert json.loads((out / "policy_postprocessor.json").read_text())["steps"][0]["registry_name"] == \
        "unnormalizer_processor"
    stats = load_file(out / pre["steps"][2]["state_file"])
    assert set(stats) == {"observation.state.q01", "observation.state.q99"}  # no action statistics: raw actions
    again, _ = resolve_normalizer(ModelConfig(state_norm="quantile", init_weights=str(out)), None)
    assert again.offset == pytest.approx(trained.offset) and again.scale == pytest.approx(trained.scale)
    assert resolve_tokenizer(ModelConfig(init_weights=str(out)))[0] == str(out / "tokenizer.model")


def test_the_writer_is_the_family_specs_and_a_family_without_one_is_refused():
    from embodyhpc.checkpoint.lerobot_export import lerobot_writer
    from embodyhpc.errors import UserError
    from embodyhpc.models.pi05.lerobot import write

    assert lerobot_writer("pi05", "/runs/r/export") is write
    with pytest.raises(UserError) as caught:
        lerobot_writer("groot", "/runs/r/export")
    message = str(caught.value)
    assert message.startswith("model.name: /runs/r/export holds a groot model, and the groot spec declares no LeRobot "
                              "exporter (fix: export a model of a family that has one (pi05), or give the groot spec "
                              "a lerobot_export") and "\n" not in message


@pytest.mark.slow  # a GR00T export through the command line (~2 s); the refusal itself: the test above
def test_a_family_without_a_lerobot_exporter_is_refused_in_one_line(cli, tmp_path):
    """GR00T's spec declares no LeRobot exporter: its export is refused naming the family, the spec field and the
    families that have one, before anything is written (not pi0.5's writer applied to GR00T's tensors)."""
    loaded = load_recipe("recipes/demo_groot_metaworld_cpu.yaml", [f"data.root={tmp_path}"])
    torch.manual_seed(0)
    source = make_export(tmp_path / "groot", build_model(loaded.config.model), config_yaml=loaded.to_yaml())
    result = cli("export", str(source), "--out", str(tmp_path / "lerobot"))
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1, result.err
    assert "holds a groot model, and the groot spec declares no LeRobot exporter" in result.err
    assert "model.name" in result.err and "(pi05)" in result.err and "lerobot_export" in result.err
    assert not (tmp_path / "lerobot").exists()
