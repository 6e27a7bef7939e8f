"""Each model family declares its sizes and the family keys of the model section it reads (ModelSpec.sizes, .keys);
validate checks a recipe through its family's spec and refuses, in one line naming the key and the fix, a family key
the family does not read. Two toy families come in as `embodyhpc.models` entry points written under tmp: `toy`
(sizes base and large, reads max_token_len) and `bare` (declares nothing). Expected messages are written here."""

from __future__ import annotations

import pytest
import yaml

from embodyhpc.config.load import find_recipe
from embodyhpc.errors import ConfigError
from embodyhpc.models.spec import ModelSpec
from embodyhpc.validation import load_recipe, load_resolved

_NEVER_CALLED = "tests.config.test_family_keys:never_called"  # validate builds nothing
TOY = ModelSpec(name="toy", sizes=("base", "large"), keys=("max_token_len",), build=_NEVER_CALLED,
                collate=_NEVER_CALLED, token_count=_NEVER_CALLED, inference=_NEVER_CALLED)
BARE = ModelSpec(name="bare", build=_NEVER_CALLED, collate=_NEVER_CALLED, token_count=_NEVER_CALLED,
                 inference=_NEVER_CALLED)


def never_called(*args, **kwargs):
    raise AssertionError("validate must not build the model")


@pytest.fixture
def families(tmp_path, monkeypatch):
    dist = tmp_path / "site" / "toy_families-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-families\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[embodyhpc.models]\ntoy = tests.config.test_family_keys:TOY\n"
                                           "bare = tests.config.test_family_keys:BARE\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))


def recipe_for(tmp_path, model: dict) -> str:
    """smoke_cpu (synthetic data, CPU) with its model section replaced."""
    data = yaml.safe_load(find_recipe("smoke_cpu").text)
    data["model"] = model
    path = tmp_path / f"{model['name']}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def refusal(recipe: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        load_recipe(recipe, overrides)
    return str(caught.value)


def test_a_family_takes_its_own_sizes_and_only_those(families, tmp_path):
    toy = recipe_for(tmp_path, {"name": "toy", "size": "base"})
    assert load_recipe(toy, ["model.size=large"]).config.model.size == "large"
    assert refusal(toy, ["model.size=small"]) == (
        "override 'model.size=small': model.size: 'small' is not one of base, large "
        "(fix: set model.size=base (or another listed value))")
    # the schema's default size is pi0.5's: a family without it names its own
    assert refusal(recipe_for(tmp_path, {"name": "toy"}), []).endswith(
        "model.size: 'tiny' is not one of base, large (fix: set model.size=base (or another listed value))")
    assert load_recipe("smoke_cpu", ["model.size=small"]).config.model.size == "small"  # pi0.5 has small


# each key with the schema's default, as an override writes it (the fix offers it back)
DEFAULTS = {"model.packing": "true", "model.state_input": "prompt", "model.state_dim": "32",
            "model.attention_backend": "auto", "model.tokenizer_path": "null"}


@pytest.mark.parametrize("override", ["model.packing=false", "model.state_input=expert", "model.state_dim=8",
                                      "model.attention_backend=sdpa_reference", "model.tokenizer_path=/t.model"])
def test_a_family_refuses_family_keys_it_does_not_read(families, tmp_path, override):
    key = override.partition("=")[0]
    assert refusal(recipe_for(tmp_path, {"name": "toy", "size": "base"}), [override]) == (
        f"override {override!r}: {key}: the toy model does not read it (its own options go under model.options) "
        f"(fix: remove it from the recipe, or override back to the defaults: {key}={DEFAULTS[key]})")


def test_every_key_a_family_does_not_read_is_named_in_one_line(families, tmp_path):
    recipe = recipe_for(tmp_path, {"name": "toy", "size": "base", "packing": False, "state_dim": 8})
    assert refusal(recipe, []).endswith(
        "model.packing: the toy model does not read it, nor model.state_dim (its own options go under "
        "model.options) (fix: remove them from the recipe, or override back to the defaults: model.packing=true "
        "model.state_dim=32)")


def test_a_key_the_family_declares_or_a_default_written_out_is_taken(families, tmp_path):
    toy = recipe_for(tmp_path, {"name": "toy", "size": "base"})
    model = load_recipe(toy, ["model.max_token_len=64", "model.packing=true"]).config.model
    assert (model.max_token_len, model.packing) == (64, True)
    bare = recipe_for(tmp_path, {"name": "bare", "action_horizon": 10, "action_dim": 4})
    assert load_recipe(bare).config.model.name == "bare"
    assert refusal(bare, ["model.size=small"]) == (
        "override 'model.size=small': model.size: the bare model does not read it (its own options go under "
        "model.options) (fix: remove it from the recipe, or override back to the defaults: model.size=tiny)")


@pytest.mark.parametrize(("override", "message"), [
    ("model.state_input=text", "model.state_input: 'text' is not one of prompt, expert"),
    ("model.state_dim=0", "model.state_dim: must be > 0, got 0"),
])
def test_pi05s_own_keys_are_checked_by_its_spec(override, message):
    assert refusal("smoke_cpu", [override]).startswith(f"override {override!r}: {message}")


def test_a_runs_resolved_config_goes_through_the_same_validation(tmp_path):
    """Jobs read resolved.yaml with load_resolved: a model its registry does not know is named with the file."""
    data = yaml.safe_load(load_recipe("smoke_cpu").to_yaml())
    data["model"]["name"] = "pi6"
    (tmp_path / "resolved.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as caught:
        load_resolved(tmp_path)
    assert str(caught.value).startswith(f"{tmp_path / 'resolved.yaml'}: model.name: unknown model 'pi6'; registered: ")


def test_validate_refuses_it_in_one_line_with_exit_2(families, tmp_path, cli):
    result = cli("validate", recipe_for(tmp_path, {"name": "toy", "size": "base"}), "model.state_input=expert")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1
    assert "model.state_input: the toy model does not read it" in result.err
