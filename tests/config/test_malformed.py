"""Bad recipes, site profiles and overrides: one line naming where and which key, exit 2,
and nothing rendered or submitted."""

from __future__ import annotations

import pytest

DEMO = "smoke_cpu"

# (override args, the key the message must name, a fragment of the message)
BAD_OVERRIDES = [
    (["train.stepz=3"], "train.stepz", "did you mean train.steps"),
    (["trian.steps=3"], "trian", "did you mean train"),
    (["resources.gpus=2"], "resources.gpus", "did you mean resources.gpus_per_node"),
    (["train.steps=abc"], "train.steps", "wrong type"),
    (["train.lr=fast"], "train.lr", "wrong type"),
    (["staging.enabled=maybe"], "staging.enabled", "wrong type"),
    (["eval.tasks=reach-v3"], "eval.tasks", "expected a list"),
    (["train.steps=null"], "train.steps", "wrong type"),
    (["resources=4"], "resources", "must be a mapping"),
    (["train.steps=0"], "train.steps", "must be > 0"),
    (["train.lr=-1"], "train.lr", "must be > 0"),
    (["resources.nodes=0"], "resources.nodes", "must be > 0"),
    (["resources.time=25:99"], "resources.time", "out of range"),
    (["resources.time=1:2:3:4"], "resources.time", "not a Slurm time limit"),
    (["resources.time=two hours"], "resources.time", "not a Slurm time limit"),
    (["resources.time=0"], "resources.time", "zero"),
    (["resources.mem=12X"], "resources.mem", "not a Slurm memory size"),
    (["resources.signal_delay_s=5000"], "resources.signal_delay_s", "not shorter than the time limit"),
    (["resources.nodes=3"], "train.global_batch_size", "not a multiple"),
    (["parallelism.dp_shard=3"], "parallelism.dp_shard", "must equal the world size"),
    (["parallelism.dp_replicate=3"], "parallelism.dp_replicate", "not divisible"),
    (["parallelism.activation_checkpointing=some"], "parallelism.activation_checkpointing", "not one of"),
    (["checkpoint.keep_latest_k=1"], "checkpoint.keep_latest_k", "no safe checkpoint"),
    (["precision.mode=fp4"], "precision.mode", "not one of"),
    (["precision.mode=fp8", "precision.fp8_backend=te"], "precision.fp8_backend", "needs GPUs"),
    (["model.size=huge"], "model.size", "not one of"),
    (["data.format=lerobot"], "data.root", "needs a dataset folder"),
    (["staging.enabled=true"], "staging.enabled", "synthetic"),
    (["data.synthetic_step_s=-0.1"], "data.synthetic_step_s", "must be >= 0"),
    (["data.synthetic_step_s=nan"], "data.synthetic_step_s", "finite"),
    (["data.synthetic_step_s=inf"], "data.synthetic_step_s", "finite"),
    (["data.synthetic_step_s=slow"], "data.synthetic_step_s", "wrong type"),
    (["data.format=lerobot", "data.root=/data", "data.synthetic_step_s=0.1"], "data.synthetic_step_s",
     "synthetic stand-in only"),
    (["eval.shards=1000"], "eval.shards", "leave shards empty"),
    (["eval.tasks=[]"], "eval.tasks", "at least one task"),
    (["network.fabric=roce", "network.gid_index=-2"], "network.gid_index", "out of range"),
    (["network.gid_index=true"], "network.gid_index", "expected an integer"),
    (["network.fabric=infiniband"], "network.fabric", "not one of"),
    (["network.extra_env={'BAD-NAME': x}"], "network.extra_env.BAD-NAME", "not a valid environment variable"),
    (["site.extra_sbatch={'--bad': x}"], "site.extra_sbatch.--bad", "not an sbatch long option"),
    (["job.name=a/b"], "job.name", "not a plain name"),
    (["train.steps"], None, "overrides are key=value"),
    (["=3"], None, "overrides are key=value"),
    (["train..steps=3"], None, "overrides are key=value"),
]


def _assert_rejected(result, *fragments):
    assert result.code == 2, (result.code, result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    for fragment in fragments:
        if fragment:
            assert fragment in lines[0], (fragment, lines[0])
    assert result.out == ""


@pytest.mark.parametrize(("overrides", "key", "message"), BAD_OVERRIDES,
                         ids=[" ".join(o) for o, _, _ in BAD_OVERRIDES])
def test_bad_override_is_one_line_exit_2(cli, overrides, key, message):
    result = cli("validate", DEMO, *overrides)
    _assert_rejected(result, key, message, "override ")


@pytest.mark.parametrize(("overrides", "key", "message"), BAD_OVERRIDES[:6])
def test_bad_override_submits_nothing(cli, runs_root, overrides, key, message):
    result = cli("submit", DEMO, f"job.runs_root={runs_root}", *overrides)
    _assert_rejected(result, key, message)
    assert list(runs_root.iterdir()) == []


BAD_FILES = [
    ("train: [1, 2\n", "invalid YAML", "line"),
    ("- a\n- b\n", "top level must be a mapping", None),
    ("trainn:\n  steps: 3\n", "unknown key", "trainn"),
    ("train:\n  steps: many\n", "wrong type", "train.steps"),
    ("train: 5\n", "must be a mapping", "train"),
    ("base: does_not_exist.yaml\n", "base recipe 'does_not_exist.yaml' not found", "base"),
    ("base: 42\n", "must name a recipe file", "base"),
    ("data:\n  format: lerobot\n  root: ???\n", "missing value", "data.root"),
    ("job:\n  name: \"x\\ny\"\n", "newline or control character", "job.name"),
    ("site:\n  partition: \"gpu\\n#SBATCH --x\"\n", "newline or control character", "site.partition"),
]


@pytest.mark.parametrize(("text", "message", "key"), BAD_FILES, ids=[m for _, m, _ in BAD_FILES])
def test_bad_recipe_file(cli, tmp_path, text, message, key):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = cli("render", str(path))
    _assert_rejected(result, message, key, str(path))


def test_base_cycle(cli, tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    _assert_rejected(cli("validate", str(tmp_path / "a.yaml")), "cycle", "base")


def test_unknown_recipe_suggests_a_shipped_one(cli):
    _assert_rejected(cli("validate", "demo_metaworld"), "recipe not found", "did you mean 'demo_metaworld_cpu'")


def test_unknown_site(cli):
    _assert_rejected(cli("validate", DEMO, "--site", "nowhere"), "site profile not found", "nowhere")


def test_site_profile_may_not_set_experiment_keys(cli, tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text("site: {partition: gpu}\ntrain: {lr: 1.0}\n")
    _assert_rejected(cli("validate", DEMO, "--site", str(site)), "only set cluster keys", "train.lr", str(site))


def test_missing_value_in_shipped_site_names_the_fix(cli):
    result = cli("validate", DEMO, "--site", "example_ib")
    _assert_rejected(result, "site.account", "missing value", "site.account=")


def test_unknown_job_kind(cli):
    _assert_rejected(cli("render", DEMO, "--job", "stage"), "--job", "train, export, eval, report")


def test_debug_variable_shows_traceback(cli, monkeypatch):
    from embodyhpc.errors import ConfigError

    monkeypatch.setenv("EMBODYHPC_DEBUG", "1")
    with pytest.raises(ConfigError):
        cli("validate", DEMO, "train.stepz=1")


# ---------------------------------------------------------------- hardening round 3, class 7: who is blamed
# The layer named is the one that last set a key the check involves: an override that breaks a value the recipe
# file (or, on resume, the run's resolved.yaml) holds is named as the override, and a file's own bad value stays the
# file's even when an override touches the same section.

BLAME = [  # (what the recipe file adds to smoke_cpu, overrides, the key named, the layer named)
    ({}, ["eval.episodes_per_task=1"], "eval.shards", "override 'eval.episodes_per_task=1'"),
    ({}, ["resources.time=00:01:00"], "resources.signal_delay_s", "override 'resources.time=00:01:00'"),
    ({"network": {"fabric": "ib", "hcas": ["mlx5_0"]}}, ["network.fabric=ethernet"], "network.hcas",
     "override 'network.fabric=ethernet'"),
    ({}, ["data.num_workers=1", "data.format=lerobot"], "data.root", "override 'data.format=lerobot'"),
    ({"data": {"format": "lerobot", "root": "/data"}}, ["data.synthetic_step_s=0.5"], "data.synthetic_step_s",
     "override 'data.synthetic_step_s=0.5'"),
    ({}, ["eval.tasks=[reach-v3]", "eval.shards=4"], "eval.shards", "override 'eval.shards=4'"),
    ({}, ["resources.nodes=3", "eval.shards=2"], "train.global_batch_size", "override 'resources.nodes=3'"),
    ({"eval": {"seeds": ["a"]}}, ["eval.shards=2"], "eval.seeds[0]", "FILE"),
    ({"data": {"delta_timestamps": {"action": ["x"]}}}, ["data.num_workers=1"], "data.delta_timestamps.action[0]",
     "FILE"),
    ({"resources": {"signal_delay_s": 5000}}, ["train.steps=10"], "resources.signal_delay_s", "FILE"),
]


@pytest.mark.parametrize(("extra", "overrides", "key", "where"), BLAME, ids=[" ".join(o) for _, o, _, _ in BLAME])
def test_the_layer_that_broke_it_is_named(cli, tmp_path, extra, overrides, key, where):
    import yaml

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"base": DEMO, **extra}))
    result = cli("validate", str(recipe), *overrides)
    _assert_rejected(result, key)
    named = str(recipe) if where == "FILE" else where
    assert result.err.startswith(f"error: {named}: {key}: "), result.err


@pytest.mark.parametrize(("overrides", "key", "where"), [
    (["train.steps=abc"], "train.steps", "override 'train.steps=abc'"),
    (["resources.time=00:01:00"], "resources.signal_delay_s", "override 'resources.time=00:01:00'"),
    (["resources.nodes=3"], "train.global_batch_size", "override 'resources.nodes=3'"),
    (["eval.seeds=[0, b]"], "eval.seeds[1]", "override 'eval.seeds=[0, b]'"),
    (["train.steps=010"], "train.steps", "override 'train.steps=010'"),
])
def test_resume_blames_its_override_not_the_runs_resolved_yaml(tmp_path, overrides, key, where):
    """resume loads the run's resolved.yaml as the recipe (site keys kept), then the overrides: what it refuses is
    the override's doing."""
    from embodyhpc.config.load import resolve_located
    from embodyhpc.errors import ConfigError
    from embodyhpc.validation import load_recipe, load_unresolved

    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(load_recipe(DEMO).to_yaml())
    with pytest.raises(ConfigError) as info:
        config, provenance, _, _ = load_unresolved(str(resolved), overrides, recipe_site_keys="keep")
        resolve_located(config, provenance)
    assert info.value.where == where and info.value.key == key, info.value.one_line()
