"""The recipe section `rl:` (embodyhpc/config/rl_schema.py) and the RL checks across sections
(embodyhpc/validation/rl_checks.py): defaults as rl-design.md fixes them, each key's own check, hostile values, the
shipped cluster recipe, the `async` key (a Python keyword) through resolved.yaml and MLflow's params."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from embodyhpc.config.load import config_data, shipped_recipes
from embodyhpc.config.schema import Config
from embodyhpc.errors import ConfigError
from embodyhpc.validation import load_config_file, load_recipe

BASE = "smoke_cpu"  # a CPU recipe whose own sections pass; RL keys come as overrides
RL_ON = ["rl.enabled=true", "model.init_weights=/models/sft", "rl.train_seeds=[100]", "rl.micro_batch_size=8"]
RECIPE = "rl_pi05_libero"
RECIPE_NEEDS = ["model.init_weights=/models/pi05_libero_sft", "model.tokenizer_path=/models/paligemma/tok.model"]

# rl-design.md's `rl:` block, copied by hand: the defaults the other RL helpers build against
DESIGN_DEFAULTS = {
    "enabled": False, "algorithm": "grpo", "async": False, "group_size": 8, "envs_per_worker": 4, "env_workers": 1,
    "rollout_workers": 1, "actor_ranks": 1, "iterations": 20, "episodes_per_iteration": 32, "micro_batch_size": 32,
    "denoise_steps": 4, "noise_level": 0.5, "execute_steps": 5, "max_episode_steps": 100, "clip_eps": 0.2,
    "behav_cap": 2.0, "max_staleness": 1, "gamma": 0.99, "gae_lambda": 0.95, "value_lr": 1.0e-4,
    "normalize_advantages": True, "queue_depth": 64, "peer_timeout_s": 120, "straggler_delay_s": 0.0,
    "train_seeds": [0],
}


def refused(overrides: list[str], recipe: str = BASE) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe, overrides)
    assert "\n" not in str(err.value)
    return err.value


def test_defaults_are_the_designs_and_leave_every_other_recipe_as_it_was():
    data = config_data(Config())["rl"]
    assert {key: data[key] for key in DESIGN_DEFAULTS} == DESIGN_DEFAULTS
    assert set(data) == {*DESIGN_DEFAULTS, "resources"}
    assert set(data["resources"]) == {"actor", "rollout", "env"}
    for recipe in shipped_recipes():
        if not recipe.startswith("rl_"):
            assert load_recipe(recipe, ["data.root=/d"], unread=("model.init_weights", "data.root")
                               ).config.rl.enabled is False, recipe


# (override, the key the one-line error names): each key's own check, and the hostile classes (text for a number,
# negative, zero where it means "unbounded", huge, NaN/inf, unknown keys at every depth, wrong shapes)
BAD = [
    ("rl.algorithm=dpo", "rl.algorithm"), ("rl.enabled=maybe", "rl.enabled"), ("rl.async=sometimes", "rl.async"),
    ("rl.group_size=eight", "rl.group_size"), ("rl.group_size=1", "rl.group_size"),
    ("rl.group_size=10000", "rl.group_size"), ("rl.envs_per_worker=0", "rl.envs_per_worker"),
    ("rl.env_workers=-1", "rl.env_workers"), ("rl.rollout_workers=1.5", "rl.rollout_workers"),
    ("rl.actor_ranks=0", "rl.actor_ranks"), ("rl.iterations=-3", "rl.iterations"),
    ("rl.iterations=99999999999999999999", "rl.iterations"), ("rl.iterations=1e12", "rl.iterations"),
    ("rl.episodes_per_iteration=12", "rl.episodes_per_iteration"),  # not whole groups of 8
    ("rl.micro_batch_size=0", "rl.micro_batch_size"), ("rl.denoise_steps=0", "rl.denoise_steps"),
    ("rl.denoise_steps=5000", "rl.denoise_steps"), ("rl.execute_steps=0", "rl.execute_steps"),
    ("rl.max_episode_steps=0", "rl.max_episode_steps"), ("rl.noise_level=-0.1", "rl.noise_level"),
    ("rl.noise_level=nan", "rl.noise_level"), ("rl.noise_level=.inf", "rl.noise_level"),
    ("rl.noise_level=1e9", "rl.noise_level"), ("rl.clip_eps=0", "rl.clip_eps"), ("rl.clip_eps=1", "rl.clip_eps"),
    ("rl.clip_eps=-0.2", "rl.clip_eps"), ("rl.clip_eps=.nan", "rl.clip_eps"), ("rl.behav_cap=0.5", "rl.behav_cap"),
    ("rl.max_staleness=-1", "rl.max_staleness"), ("rl.gamma=0", "rl.gamma"), ("rl.gamma=1.5", "rl.gamma"),
    ("rl.gae_lambda=-0.1", "rl.gae_lambda"), ("rl.value_lr=0", "rl.value_lr"), ("rl.value_lr=abc", "rl.value_lr"),
    ("rl.queue_depth=0", "rl.queue_depth"), ("rl.queue_depth=100000000", "rl.queue_depth"),
    ("rl.peer_timeout_s=0", "rl.peer_timeout_s"), ("rl.peer_timeout_s=1e9", "rl.peer_timeout_s"),
    ("rl.straggler_delay_s=-1", "rl.straggler_delay_s"), ("rl.train_seeds=[]", "rl.train_seeds"),
    ("rl.train_seeds=[-1]", "rl.train_seeds"), ("rl.train_seeds=[1, 1]", "rl.train_seeds"),
    ("rl.train_seeds=[a]", "rl.train_seeds[0]"), ("rl.train_seeds=[4294967296]", "rl.train_seeds"),
    ("rl.train_seeds=3", "rl.train_seeds"),
    ("rl.bogus=1", "rl.bogus"), ("rl.async_=true", "rl.async_"), ("rl.resources.gpu={}", "rl.resources.gpu"),
    ("rl.resources.actor.gpus=1", "rl.resources.actor.gpus"), ("rl=[]", "rl"),
    ("rl.resources.env=5", "rl.resources.env"),
    ("rl.resources.actor.nodes=0", "rl.resources.actor.nodes"),
    ("rl.resources.rollout.gpus_per_node=-1", "rl.resources.rollout.gpus_per_node"),
    ("rl.resources.rollout.gpus_per_node=100", "rl.resources.rollout.gpus_per_node"),
    ("rl.resources.env.cpus_per_task=0", "rl.resources.env.cpus_per_task"),
    ("rl.resources.env.mem=lots", "rl.resources.env.mem"),
    ("rl.resources.env.partition='cpu; rm -rf /'", "rl.resources.env.partition"),
    ("rl.resources.actor.tasks_per_node=2", "rl.resources.actor.tasks_per_node"),  # 1 actor rank on 1 node
    ("rl.resources.actor.nodes=2", "rl.resources.actor.nodes"),  # 1 actor rank over 2 nodes
]


@pytest.mark.parametrize("override, key", BAD)
def test_each_bad_value_is_one_line_naming_the_override_and_the_key(override, key):
    err = refused([override])
    assert err.key == key, err.one_line()
    assert err.where == f"override {override!r}", err.one_line()


@pytest.mark.parametrize("overrides, key, related", [
    (["rl.async=true", "rl.max_staleness=0"], "rl.max_staleness", "rl.async"),
    (["rl.actor_ranks=16", "rl.episodes_per_iteration=8"], "rl.episodes_per_iteration", "rl.actor_ranks"),
    (["rl.group_size=16", "rl.episodes_per_iteration=24"], "rl.episodes_per_iteration", "rl.group_size"),
])
def test_keys_that_only_fail_together(overrides, key, related):
    err = refused(overrides)
    assert err.key == key and related in err.one_line(), err.one_line()
    assert load_recipe(BASE, overrides[:1]) and load_recipe(BASE, overrides[1:])  # each alone is fine


def test_ppo_needs_no_whole_groups_and_async_with_staleness_is_accepted():
    rl = load_recipe(BASE, ["rl.algorithm=ppo", "rl.group_size=1", "rl.episodes_per_iteration=7"]).config.rl
    assert (rl.algorithm, rl.group_size, rl.episodes_per_iteration) == ("ppo", 1, 7)
    assert load_recipe(BASE, ["rl.async=true", "rl.max_staleness=1"]).config.rl.async_ is True


def test_groups_resolve_tasks_per_node_from_the_role_counts():
    rl = load_recipe(BASE, ["rl.actor_ranks=8", "rl.resources.actor.nodes=2", "rl.rollout_workers=3",
                            "rl.env_workers=4", "rl.resources.env.nodes=3"]).config.rl
    assert [(g.role, g.nodes, g.tasks_per_node, g.tasks) for g in map(rl.group, ("actor", "rollout", "env"))] == [
        ("actor", 2, 4, 8), ("rollout", 1, 3, 3), ("env", 3, 4, 12)]
    assert rl.role_sizes() == {"actor": 8, "rollout": 3, "env": 12}


# ---- across sections (validation/rl_checks.py): only for an RL recipe ----
MIXTURE = ["data.format=lerobot", "data.root=null", "data.datasets=[{root: /d/a}, {root: /d/b}]"]


@pytest.mark.parametrize("overrides, key, fix", [
    (["rl.train_seeds=[0, 7]"], "rl.train_seeds", "rl.train_seeds=[1]"),  # eval.seeds is [0]: not held out
    (["model.init_weights=null"], "model.init_weights", "model.init_weights=/path/to/export"),
    (["rl.execute_steps=11"], "rl.execute_steps", "rl.execute_steps=10"),  # model.action_horizon is 10
    (["rl.micro_batch_size=5", "rl.async=true"], "train.global_batch_size", "multiple of 5"),  # 16 per step
    (["rl.actor_ranks=32", "rl.micro_batch_size=1", "rl.async=true"], "train.global_batch_size", "multiple of 32"),
    (["eval.every_k_checkpoints=1"], "eval.every_k_checkpoints", "eval.every_k_checkpoints=0"),
    (["eval.tasks=[reach-v9]"], "eval.tasks", "reach-v3"),  # where RL trains: the suite's tasks
    (MIXTURE, "data.datasets", "data.datasets=null"),  # RL's statistics are one dataset's
])
def test_an_rl_recipe_is_checked_across_its_sections(overrides, key, fix):
    err = refused([*RL_ON, *overrides])
    assert err.key == key and fix in (err.fix or ""), err.one_line()
    if key != "eval.tasks":
        alone = {"model.init_weights": [], "data.datasets": MIXTURE}.get(key, overrides[:1])
        assert load_recipe(BASE, alone), "only when rl.enabled"
    if key == "train.global_batch_size":  # synchronous: a version is a round of episodes, the batch is not read
        assert load_recipe(BASE, [*RL_ON, *overrides[:-1]]).config.rl.async_ is False


def test_held_out_seeds_and_a_starting_policy_make_a_valid_rl_recipe():
    config = load_recipe(BASE, [*RL_ON, "rl.actor_ranks=2"]).config
    assert config.rl.enabled and not set(config.rl.train_seeds) & set(config.eval.seeds)


def test_refusals_are_one_line_with_exit_2_through_the_cli(cli):
    result = cli("validate", BASE, *RL_ON, "rl.train_seeds=[0]")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1, result.err
    assert "rl.train_seeds" in result.err and "eval.seeds" in result.err and "fix:" in result.err
    result = cli("validate", BASE, "rl.resources.actor.gpu=1")
    assert result.code == 2 and "did you mean rl.resources.actor.gpus_per_node" in result.err


# ---- `async`: a recipe key, a Python keyword ----
def test_async_round_trips_through_resolved_yaml_under_its_recipe_key(tmp_path):
    loaded = load_recipe(BASE, ["rl.async=true", "rl.max_staleness=2"])
    text = loaded.to_yaml()
    assert "  async: true\n" in text and "async_:" not in text
    (tmp_path / "resolved.yaml").write_text(text)
    again = load_config_file(tmp_path / "resolved.yaml")
    assert again == loaded.config and again.rl.async_ is True
    assert loaded.provenance["rl.async"] == "override 'rl.async=true'"


def test_mlflow_params_hold_the_rl_section_under_its_recipe_keys(runs_root, monkeypatch):
    """`submit` creates the run's MLflow run with the recipe as params: caught at mlflow_run.create_run (which
    flattens them as below), the chain itself not started."""
    from embodyhpc import submit
    from embodyhpc.orchestrate import api
    from embodyhpc.tracking import mlflow_run
    from embodyhpc.tracking.mlflow_values import flatten_params

    given: dict = {}
    monkeypatch.setattr(mlflow_run, "create_run", lambda uri, **kwargs: given.update(kwargs) or "mlflow-run-1")
    monkeypatch.setattr(api, "run_chain", lambda loaded, info, **kwargs: info)
    loaded = load_recipe(RECIPE, [*RECIPE_NEEDS, f"job.runs_root={runs_root}"])
    info = submit.submit(loaded, sys.executable, local=True, progress=lambda message: None)
    assert info.mlflow_run_id == "mlflow-run-1"
    params = flatten_params(given["params"])
    assert params["rl.enabled"] == "True" and params["rl.async"] == "False" and params["rl.algorithm"] == "ppo"
    assert params["rl.resources.actor.gpus_per_node"] == "8" and params["rl.train_seeds"] == "[1]"
    assert "rl.async_" not in params


# ---- the shipped cluster recipe ----
def test_the_cluster_recipe_is_rlinfs_pi05_setting_and_leaves_the_starting_policy_to_the_user():
    err = refused(RECIPE_NEEDS[1:], RECIPE)
    assert err.key == "model.init_weights" and "???" in err.one_line()
    cfg = load_recipe(RECIPE, [*RECIPE_NEEDS, "site.account=robotics"], site="example_ib").config
    rl = cfg.rl
    sizes = rl.role_sizes()
    # rl-vla.md: 64 envs, 5-step chunks, few flow steps, global batch 2048, lr 5e-6 / 1e-4, groups of 8
    assert (sizes["env"] * rl.envs_per_worker, rl.execute_steps, rl.denoise_steps) == (64, 5, 4)
    assert (cfg.train.global_batch_size, cfg.train.lr, rl.value_lr, rl.group_size) == (2048, 5e-6, 1e-4, 8)
    assert (cfg.eval.suite, cfg.eval.tasks, cfg.model.name, cfg.model.size) == ("libero", ["libero_spatial"],
                                                                                 "pi05", "full")
    groups = [rl.group(role) for role in ("actor", "rollout", "env")]
    assert [(g.nodes, g.gpus_per_node) for g in groups] == [(2, 8), (1, 8), (2, 0)]
    assert sizes["actor"] * rl.micro_batch_size == cfg.train.global_batch_size  # no accumulation
    assert rl.episodes_per_iteration % rl.group_size == 0 and not set(rl.train_seeds) & set(cfg.eval.seeds)


def test_the_cluster_recipe_validates_dry_runs_and_is_listed_with_its_marks(cli, runs_root):
    result = cli("validate", RECIPE, *RECIPE_NEEDS)
    assert result.code == 0, result.err
    assert "rl: ppo, sync, 400 versions; actor 2 node(s) x 8 = 16, rollout 1 node(s) x 8 = 8" in result.out
    assert "(64 envs)" in result.out
    result = cli("submit", RECIPE, *RECIPE_NEEDS, f"job.runs_root={runs_root}", "--dry-run")
    assert result.code == 0, result.err
    assert "/scripts/rl.sbatch" in result.out and "--dependency=afterok:<rl>" in result.out  # rl -> eval -> report
    assert "#SBATCH hetjob" in cli("render", RECIPE, *RECIPE_NEEDS, "--job", "rl").out
    assert RECIPE in cli("recipes", "list").out.split()
    shown = cli("recipes", "show", RECIPE)
    assert shown.code == 0 and "init_weights: ???  # must be set" in shown.out
    assert "model.init_weights: yours to set" in shown.err


def test_rl_keys_are_refused_in_a_site_profile(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("rl:\n  enabled: true\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(BASE, site=str(site))
    assert err.value.key == "rl.enabled" and "site profile" in err.value.message


def test_replace_keeps_the_checks():
    rl = Config().rl
    with pytest.raises(ConfigError):
        dataclasses.replace(rl, clip_eps=2.0)
