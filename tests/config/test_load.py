"""Loading recipes: defaults, base recipes, site profiles, overrides, provenance."""

from __future__ import annotations

import pytest

from embodyhpc.config.load import shipped_recipes, shipped_sites
from embodyhpc.errors import ConfigError
from embodyhpc.validation import load_recipe

TOK = "model.tokenizer_path=/models/paligemma/tokenizer.model"
NEEDS = ["data.root=/data/set", "site.account=robotics", TOK]


def test_shipped_inventory():
    assert shipped_recipes() == ["demo_groot_metaworld_cpu", "demo_metaworld_cpu", "groot_n15_bf16", "libero_cpu",
                                 "pi05_bf16", "pi05_fp8", "pi05_libero", "rl_groot_metaworld_cpu", "rl_metaworld_cpu",
                                 "rl_pi05_libero", "rl_ppo_metaworld_cpu", "smoke_cpu"]
    assert shipped_sites() == ["example_ib", "example_roce", "example_tcp", "local"]


@pytest.mark.parametrize("site", ["local", "example_ib", "example_roce", "example_tcp"])
@pytest.mark.parametrize("recipe", ["demo_metaworld_cpu", "smoke_cpu", "pi05_bf16", "pi05_fp8", "libero_cpu",
                                    "pi05_libero", "demo_groot_metaworld_cpu", "groot_n15_bf16"])
def test_every_shipped_recipe_loads_on_every_site(recipe, site):
    cpu_recipe = recipe in ("smoke_cpu", "demo_metaworld_cpu", "demo_groot_metaworld_cpu")
    overrides = list(NEEDS) if not cpu_recipe else ["site.account=robotics"] * (site != "local")
    overrides += ["model.init_weights=/models/pi05_base"] * (recipe == "pi05_libero")
    loaded = load_recipe(recipe, overrides, site=site)
    assert loaded.resolved.world_size == loaded.config.resources.nodes * loaded.resolved.procs_per_node


def test_fp8_recipe_inherits_from_bf16_and_overrides_precision():
    fp8 = load_recipe("recipes/pi05_fp8.yaml", ["data.root=/d", TOK])
    bf16 = load_recipe("recipes/pi05_bf16.yaml", ["data.root=/d", TOK])
    assert fp8.config.precision.mode == "fp8" and bf16.config.precision.mode == "bf16"
    assert fp8.config.job.name == "pi05-fp8"
    assert fp8.config.model == bf16.config.model and fp8.config.train == bf16.config.train
    assert (fp8.resolved.world_size, fp8.resolved.dp_replicate, fp8.resolved.dp_shard) == (32, 4, 8)
    assert fp8.config.model.size == "full"
    assert fp8.provenance["precision.mode"].endswith("pi05_fp8.yaml")
    assert fp8.provenance["model.size"].endswith("pi05_bf16.yaml")


def test_libero_recipe_fine_tunes_from_weights_the_user_names_and_evaluates_on_gpu_shards():
    with pytest.raises(ConfigError) as err:
        load_recipe("pi05_libero", NEEDS, site="example_ib")
    assert err.value.key == "model.init_weights" and "???" in str(err.value)
    loaded = load_recipe("pi05_libero", [*NEEDS, "model.init_weights=/models/pi05_base"], site="example_ib")
    config = loaded.config
    assert config.model.init_weights == "/models/pi05_base" and config.precision.mode == "bf16"
    assert (config.resources.nodes, config.resources.gpus_per_node) == (4, 8)
    assert (config.eval.suite, list(config.eval.tasks), config.eval.episodes_per_task) == ("libero", ["libero"], 50)
    assert (config.eval.gpus_per_task, config.eval.envs_per_shard) == (1, 8)


def test_envs_per_shard_need_a_core_each(cli):
    result = cli("validate", "smoke_cpu", "eval.envs_per_shard=3", "eval.cpus_per_task=2")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1
    assert "eval.envs_per_shard" in result.err and "eval.cpus_per_task=4" in result.err
    assert cli("validate", "smoke_cpu", "eval.envs_per_shard=3", "eval.cpus_per_task=3").code == 0


def test_precedence_defaults_recipe_site_overrides():
    loaded = load_recipe("pi05_bf16", [*NEEDS, "job.runs_root=/override"], site="example_ib")
    assert loaded.config.job.runs_root == "/override"  # override beats site
    assert loaded.config.tracking.mlflow_uri.startswith("http://")  # site
    assert loaded.config.train.lr == 5e-5  # recipe beats defaults
    assert loaded.config.checkpoint.async_save is True  # schema default
    assert loaded.provenance["job.runs_root"] == "override 'job.runs_root=/override'"
    assert loaded.provenance["network.fabric"] == "embodyhpc:sites/example_ib.yaml"


def test_site_from_environment(monkeypatch):
    monkeypatch.setenv("EMBODYHPC_SITE", "local")
    assert load_recipe("smoke_cpu").config.site.partition == "debug"
    monkeypatch.delenv("EMBODYHPC_SITE")
    assert load_recipe("smoke_cpu").config.site.partition is None


def test_user_recipe_with_relative_base_and_shipped_base(tmp_path):
    (tmp_path / "mine.yaml").write_text("base: parent.yaml\ntrain: {steps: 70}\n")
    (tmp_path / "parent.yaml").write_text("base: smoke_cpu\ntrain: {lr: 0.5}\n")
    loaded = load_recipe(str(tmp_path / "mine.yaml"))
    assert (loaded.config.train.steps, loaded.config.train.lr) == (70, 0.5)
    assert loaded.config.job.name == "smoke"


def test_site_profile_from_path(tmp_path):
    site = tmp_path / "cluster.yaml"
    site.write_text("site: {partition: big, qos: high}\nnetwork: {fabric: ib, hcas: ['mlx5_0:1']}\n")
    loaded = load_recipe("smoke_cpu", site=str(site))
    assert (loaded.config.site.partition, loaded.config.network.fabric) == ("big", "ib")
    assert loaded.site == str(site)


def test_interpolation_between_keys():
    loaded = load_recipe("smoke_cpu", ["job.experiment=${job.name}-exp"])
    assert loaded.config.job.experiment == "smoke-exp"


def test_config_is_frozen():
    loaded = load_recipe("smoke_cpu")
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        loaded.config.train.steps = 3  # type: ignore[misc]


def test_resolved_yaml_round_trips(tmp_path):
    from embodyhpc.validation import load_resolved

    loaded = load_recipe("pi05_fp8", [*NEEDS], site="example_ib")
    (tmp_path / "resolved.yaml").write_text(loaded.to_yaml())
    assert load_resolved(tmp_path) == loaded.config


def test_batch_arithmetic():
    loaded = load_recipe("smoke_cpu", ["train.global_batch_size=64", "train.micro_batch_size=8"])
    assert loaded.resolved.grad_accum_steps == 4  # 64 / (8 x 2 ranks)


def test_cross_section_error_blames_the_latest_layer():
    with pytest.raises(ConfigError) as info:
        load_recipe("smoke_cpu", ["resources.nodes=3"])
    assert info.value.where == "override 'resources.nodes=3'"
    assert "world_size=3" in info.value.message


def test_unquoted_slurm_times_stay_strings(tmp_path):
    """YAML 1.1 would read 01:30:00 as the integer 5400 (then 5400 minutes for Slurm)."""
    (tmp_path / "r.yaml").write_text("base: smoke_cpu\nresources: {time: 01:30:00}\n"
                                     "eval: {time: 45}\ntrain: {lr: 1.0e-3, steps: 16}\n")
    loaded = load_recipe(str(tmp_path / "r.yaml"))
    assert loaded.config.resources.time == "01:30:00" and loaded.resolved.train_time_min == 90
    assert loaded.config.eval.time == "45" and loaded.resolved.eval_time_min == 45
    assert loaded.config.train.lr == 1e-3 and loaded.config.train.steps == 16
