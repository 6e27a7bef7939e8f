"""Issue 16, class 9: secrets pass from the submitting environment to jobs and are never written down.

Chosen behaviour: a secret read into the recipe (`${oc.env:HF_TOKEN}`) or written into site.env is refused (not
redacted): the profile lists it in site.secrets instead. Run folders are 0700, files that can hold what a job's
environment holds are 0600, and MLflow params redact the values of secret-looking keys.
"""

from __future__ import annotations

import os
import stat

import pytest
import yaml

from embodyhpc.config.guards import looks_secret
from embodyhpc.validation import load_recipe
from tests.helpers import one_line_error

DEMO = "smoke_cpu"
VALUE = "hf_sekrit_value_0123456789"


def _assert_rejected(result, *fragments: str) -> str:
    line = one_line_error(result, *fragments)
    assert VALUE not in result.out + result.err
    return line


def _site(tmp_path, data: dict):
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


SECRET_READS = [
    {"site": {"env": {"HF_TOKEN": "${oc.env:HF_TOKEN}"}}},
    {"site": {"env": {"WANDB_API_KEY": "${oc.env:WANDB_API_KEY}"}}},
    {"site": {"env": {"TOKEN_COPY": "${oc.env:HF_TOKEN,default}"}}},
    {"site": {"env": {"HF": "${oc.env:'HF_TOKEN'}"}}},
    {"network": {"extra_env": {"X": "${oc.env:AWS_SECRET_ACCESS_KEY}"}}},
    {"site": {"extra_sbatch": {"comment": "${oc.env:GITHUB_TOKEN}"}}},
    {"tracking": {"mlflow_uri": "http://u:${oc.env:MLFLOW_TRACKING_PASSWORD}@mlflow:5000"}},
]


@pytest.mark.parametrize("data", SECRET_READS, ids=[str(d)[:50] for d in SECRET_READS])
def test_secret_read_into_a_site_profile_is_refused(cli, tmp_path, monkeypatch, data):
    for name in ("HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, VALUE)
    site = _site(tmp_path, data)
    _assert_rejected(cli("render", DEMO, "--site", str(site)), str(site), "site.secrets")


@pytest.mark.parametrize("override", ["site.env.HF_TOKEN=${oc.env:HF_TOKEN}", "job.name=${oc.env:HF_TOKEN}",
                                      "job.experiment=${oc.env:${site.name}}", "job.name=${oc.env:'${job.experiment}'}",
                                      "network.extra_env.NCCL_X=${oc.env:WANDB_API_KEY}",
                                      "site.extra_sbatch.comment=${oc.env:DB_PASSWORD}"])
def test_secret_read_in_an_override_is_refused(cli, monkeypatch, override):
    monkeypatch.setenv("HF_TOKEN", VALUE)
    monkeypatch.setenv("WANDB_API_KEY", VALUE)
    monkeypatch.setenv("DB_PASSWORD", VALUE)
    _assert_rejected(cli("render", DEMO, override), "override")


@pytest.mark.parametrize("name", ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD",
                                  "GOOGLE_APPLICATION_CREDENTIALS", "NPM_AUTH", "MY_SECRET"])
def test_literal_secret_in_site_env_is_refused(cli, tmp_path, name):
    site = _site(tmp_path, {"site": {"env": {name: VALUE}}})
    _assert_rejected(cli("validate", DEMO, "--site", str(site)), f"site.env.{name}", "site.secrets")


# Every place a recipe hands a job a variable's value goes through one name check (config.checks.secret_variable):
# site.env, network.extra_env, and NAME=value pairs of srun's --export among site.container.extra_args.
LITERAL_SECRETS = [  # (layer, data or override, key the error names)
    ("site", {"network": {"extra_env": {"HF_TOKEN": VALUE}}}, "network.extra_env.HF_TOKEN"),
    ("recipe", {"network": {"extra_env": {"MY_SECRET": VALUE}}}, "network.extra_env.MY_SECRET"),
    ("override", f"network.extra_env.WANDB_API_KEY={VALUE}", "network.extra_env.WANDB_API_KEY"),
    ("override", f"network.extra_env={{NCCL_DEBUG_SUBSYS: INIT, GITHUB_TOKEN: {VALUE}}}",
     "network.extra_env.GITHUB_TOKEN"),
    ("override", f"site.env={{HF_TOKEN: {VALUE}}}", "site.env.HF_TOKEN"),
    ("site", {"site": {"env": {"DB_PASSWORD": VALUE}}}, "site.env.DB_PASSWORD"),
    ("site", {"site": {"container": {"image": "img", "extra_args": [f"--export=ALL,HF_TOKEN={VALUE}"]}}},
     "site.container.extra_args"),
    ("site", {"site": {"container": {"image": "img",
                                     "extra_args": ["--export", f"ALL,AWS_SECRET_ACCESS_KEY={VALUE}"]}}},
     "site.container.extra_args"),
    ("site", {"site": {"container": {"image": "img", "extra_args": [f"--expo=NPM_AUTH={VALUE}"]}}},
     "site.container.extra_args"),
]


def _args(tmp_path, layer: str, data) -> tuple[list[str], str]:
    """CLI arguments setting `data` in `layer` on top of smoke_cpu, and the file (or override) an error names."""
    if layer == "override":
        return [DEMO, data], "error: override"
    if layer == "site":
        return [DEMO, "--site", str(_site(tmp_path, data))], str(tmp_path / "site.yaml")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"base": DEMO, **data}))
    return [str(recipe)], str(recipe)


@pytest.mark.parametrize(("layer", "data", "key"), LITERAL_SECRETS,
                         ids=[f"{layer}:{key}" for layer, _, key in LITERAL_SECRETS])
def test_a_literal_secret_given_to_a_job_is_refused_wherever_it_is_set(cli, tmp_path, runs_root, layer, data, key):
    """One line naming the file (or override), the key and the fix; the value never printed; exit 2 and nothing
    written (no run folder, resolved.yaml, script or MLflow run)."""
    args, where = _args(tmp_path, layer, data)
    line = _assert_rejected(cli("validate", *args), where, f"{key}:", "looks like a secret", "site.secrets")
    assert line.index(where) < line.index(key) < line.index("(fix: list ")
    _assert_rejected(cli("render", *args), key)
    _assert_rejected(cli("submit", *args, f"job.runs_root={runs_root}"), key)
    assert list(runs_root.iterdir()) == []


def test_names_without_values_pass_the_submitting_environment_on(cli, tmp_path):
    """srun --export of a name alone and pyxis's --container-env hand the job the value of the environment `submit`
    runs in: no file holds it. Ordinary NAME=value pairs stay allowed."""
    extra = ["--export=ALL,HF_TOKEN", "--container-env=HF_TOKEN,WANDB_API_KEY", "--export", "ALL,OMP_NUM_THREADS=4",
             "--exclusive"]
    site = _site(tmp_path, {"site": {"container": {"image": "img", "extra_args": extra}}})
    result = cli("render", DEMO, "--site", str(site), "--job", "train")
    assert result.code == 0, result.err
    assert "--export=ALL,HF_TOKEN --container-env=HF_TOKEN,WANDB_API_KEY --export ALL,OMP_NUM_THREADS=4" in result.out


def test_every_variable_a_job_script_exports_comes_from_a_checked_place(cli, tmp_path):
    """The class closed: a rendered job exports embodyhpc's own variables, the network profile's typed fields, and
    the variables of the sections credentials.ENV_SECTIONS lists (each refuses a secret-looking name: the test
    above, and the one below for every listed section). A new source of exported variables fails here until it is
    listed and checked."""
    import re

    from embodyhpc.config.credentials import ENV_SECTIONS
    from embodyhpc.config.network import NetworkConfig

    assert set(ENV_SECTIONS) == {"site.env", "network.extra_env"}
    site = _site(tmp_path, {"site": {"env": {"SITE_PROBE": "1"}}, "network": {"extra_env": {"NET_PROBE": "2"},
                                                                               "fabric": "ib", "gid_index": 3}})
    for job in ("train", "eval", "report"):
        result = cli("render", DEMO, "--site", str(site), "--job", job)
        assert result.code == 0, result.err
        exported = set(re.findall(r"^export ([A-Za-z_][A-Za-z0-9_]*)=", result.out, re.MULTILINE))
        typed = set(NetworkConfig(fabric="ib", gid_index=3).environment())
        own = {"EMBODYHPC_RUN_DIR", "EMBODYHPC_JOB_KIND", "SUBMITIT_EXECUTOR"}
        assert "SITE_PROBE" in exported and exported - own - typed - {"SITE_PROBE", "NET_PROBE"} == set(), job


@pytest.mark.parametrize("section", ["site.env", "network.extra_env"])
def test_each_listed_section_refuses_a_secret_looking_name(section):
    from embodyhpc.config.credentials import ENV_SECTIONS
    from embodyhpc.errors import ConfigError

    assert section in ENV_SECTIONS
    with pytest.raises(ConfigError) as info:
        load_recipe(DEMO, [f"{section}.SERVICE_API_KEY={VALUE}"])
    assert info.value.key == f"{section}.SERVICE_API_KEY" and VALUE not in info.value.one_line()


def test_other_environment_reads_stay_allowed(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("MY_PARTITION", "gpu-a")
    site = _site(tmp_path, {"site": {"partition": "${oc.env:MY_PARTITION}", "env": {"HOME_COPY": "${oc.env:HOME}"}}})
    result = cli("render", DEMO, "--site", str(site), "--job", "train")
    assert result.code == 0, result.err
    assert "#SBATCH --partition=gpu-a" in result.out


def test_named_secrets_never_reach_scripts_config_or_params(cli, tmp_path, monkeypatch, runs_root):
    monkeypatch.setenv("HF_TOKEN", VALUE)
    monkeypatch.setenv("WANDB_API_KEY", VALUE)
    site = _site(tmp_path, {"site": {"secrets": ["HF_TOKEN", "WANDB_API_KEY"]}})
    result = cli("submit", DEMO, "--site", str(site), f"job.runs_root={runs_root}", "--dry-run")
    assert result.code == 0, result.err
    assert VALUE not in result.out + result.err
    loaded = load_recipe(DEMO, [f"job.runs_root={runs_root}"], site=str(site))
    assert VALUE not in loaded.to_yaml()
    assert loaded.config.site.secrets == ["HF_TOKEN", "WANDB_API_KEY"]


def test_unset_secret_is_a_warning_at_dry_run(cli, tmp_path, monkeypatch, runs_root):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    site = _site(tmp_path, {"site": {"secrets": ["HF_TOKEN"]}})
    result = cli("submit", DEMO, "--site", str(site), f"job.runs_root={runs_root}", "--dry-run")
    assert result.code == 0, result.err
    assert "warning: site.secrets names HF_TOKEN, not set in your environment" in result.err


@pytest.mark.parametrize("names", [["BAD-NAME"], ["1X"], ["A B"]])
def test_secret_names_must_be_variable_names(cli, tmp_path, names):
    site = _site(tmp_path, {"site": {"secrets": names}})
    _assert_rejected(cli("validate", DEMO, "--site", str(site)), "site.secrets")


def test_run_folder_and_its_files_are_private(tmp_path, monkeypatch):
    from embodyhpc.orchestrate.api import start_run
    from embodyhpc.rundir import RUN_JSON, SUBDIRS, new_run_dir

    monkeypatch.setenv("HF_TOKEN", VALUE)
    old = os.umask(0o022)
    try:
        site = _site(tmp_path, {"site": {"secrets": ["HF_TOKEN"]}})
        loaded = load_recipe(DEMO, [f"job.runs_root={tmp_path / 'runs'}"], site=str(site))
        run_dir = new_run_dir(str(tmp_path / "runs"), "exp", "name")
        start_run(loaded, run_dir, backend="local", python="/usr/bin/python3", mlflow_run_id=None)
    finally:
        os.umask(old)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for sub in SUBDIRS:
        assert stat.S_IMODE((run_dir / sub).stat().st_mode) == 0o700, sub
    for name in ("resolved.yaml", RUN_JSON):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600, name
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert VALUE not in path.read_text(errors="replace"), path


def test_write_private_tightens_an_existing_file(tmp_path):
    from embodyhpc.rundir import write_private

    path = tmp_path / "train.sbatch"
    path.write_text("old")
    path.chmod(0o644)
    write_private(path, "new")
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_mlflow_params_redact_secret_looking_keys():
    from embodyhpc.tracking.mlflow_run import flatten_params

    params = flatten_params({"site": {"env": {"HF_TOKEN": VALUE, "OMP_NUM_THREADS": "4"}},
                             "tracking": {"password": VALUE, "api_key": VALUE, "credentials": VALUE},
                             "model": {"max_token_len": 816, "tokenizer_path": "/t.model"}})
    assert VALUE not in str(params)
    assert params["site.env.HF_TOKEN"] == "***" and params["site.env.OMP_NUM_THREADS"] == "4"
    assert params["model.max_token_len"] == "816" and params["model.tokenizer_path"] == "/t.model"


@pytest.mark.parametrize(("name", "secret"), [
    ("HF_TOKEN", True), ("WANDB_API_KEY", True), ("aws_secret_access_key", True), ("db.password", True),
    ("GITHUB_PAT_TOKEN", True), ("MLFLOW_TRACKING_PASSWORD", True), ("apiKey", True), ("credentials", True),
    ("tokenizer_path", False), ("max_token_len", False), ("keep_latest_k", False), ("NCCL_IB_PKEY", False),
    ("OMP_NUM_THREADS", False), ("HF_HUB_OFFLINE", False)])
def test_looks_secret(name, secret):
    assert looks_secret(name) is secret


# ---------------------------------------------------------------- hardening round 3, class 4: credentials in URIs
# Chosen behaviour: a URI that carries a credential is refused in any key (not masked: resolved.yaml is what jobs
# read, and a masked URI would no longer log in); every message that quotes it shows it masked; masking by name is
# for the variables of site.env / network.extra_env only, so no ordinary setting turns into ***.

URI_SECRETS = [  # (layer, key, value): every value holds VALUE as its credential
    ("override", "tracking.mlflow_uri", f"http://alice:{VALUE}@mlflow.example:5000"),
    ("override", "tracking.mlflow_uri", f"https://mlflow.example/?token={VALUE}"),
    ("override", "tracking.mlflow_uri", f"http://alice:pa@ss/w?rd{VALUE}@mlflow.example:5000"),
    ("site", "tracking.mlflow_uri", f"postgresql://mlflow:{VALUE}@db.example:5432/mlflow"),
    ("site", "site.env.DATA_URL", f"https://alice:{VALUE}@data.example/x"),
    ("site", "site.env.REPO", f"https://ghp_{VALUE}@github.com/org/repo.git"),
    ("site", "network.extra_env.PROXY", f"http://proxy:{VALUE}@proxy.example:3128"),
    ("site", "site.container.image", f"docker://alice:{VALUE}@nvcr.io#nvidia/pytorch:24.05-py3"),
    ("recipe", "data.root", f"s3://bucket/demos?X-Amz-Date=1&X-Amz-Signature={VALUE}"),
    ("recipe", "eval.weights", f"https://acct.blob.core.windows.net/c/export?sv=2022&sig={VALUE}"),
    ("recipe", "model.init_weights", f"https://hub.example/w.safetensors?access_token={VALUE}"),
]


def _write_layer(tmp_path, layer: str, key: str, value: str) -> list[str]:
    """The CLI arguments that set `key` to `value` in `layer` (smoke_cpu underneath)."""
    if layer == "override":
        return [DEMO, f"{key}={value}"]
    nested: dict = {}
    node = nested
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    if layer == "site":
        return [DEMO, "--site", str(_site(tmp_path, nested))]
    if key == "data.root":
        nested["data"]["format"] = "lerobot"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"base": DEMO, **nested}))
    return [str(recipe)]


@pytest.mark.parametrize(("layer", "key", "value"), URI_SECRETS, ids=[f"{k}:{v[:30]}" for _, k, v in URI_SECRETS])
def test_a_credential_in_a_uri_is_refused_and_never_printed(cli, tmp_path, runs_root, layer, key, value):
    args = _write_layer(tmp_path, layer, key, value)
    where = {"override": "error: override", "site": str(tmp_path / "site.yaml"),
             "recipe": str(tmp_path / "recipe.yaml")}[layer]
    line = _assert_rejected(cli("validate", *args), where, f"{key}:", "***", "site.secrets" if layer != "site" or
                            "container" not in key else "enroot")
    assert "ss/w?rd" not in line  # a password holding @, / and ? is masked whole
    _assert_rejected(cli("submit", *args, f"job.runs_root={runs_root}"), key)
    assert list(runs_root.iterdir()) == []  # nothing created: no resolved.yaml, run.json or MLflow run to hold it


def test_the_mlflow_fix_names_the_variables_mlflow_reads(cli):
    line = _assert_rejected(cli("validate", DEMO, f"tracking.mlflow_uri=http://alice:{VALUE}@mlflow.example:5000"))
    assert "set tracking.mlflow_uri=http://mlflow.example:5000 " in line
    assert "MLFLOW_TRACKING_USERNAME" in line and "MLFLOW_TRACKING_PASSWORD" in line and "alice:***@" in line


def test_a_credential_built_by_interpolation_is_refused(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_PART", VALUE)  # a name that does not look secret: only the result gives it away
    site = _site(tmp_path, {"tracking": {"mlflow_uri": "http://alice:${oc.env:MLFLOW_PART}@mlflow.example:5000"}})
    _assert_rejected(cli("validate", DEMO, "--site", str(site)), str(site), "tracking.mlflow_uri", "***")


def test_credentials_in_a_misplaced_option_or_a_refused_resume_are_masked(cli, tmp_path):
    line = _assert_rejected(cli("validate", DEMO, f"--tracking.mlflow_uri=http://alice:{VALUE}@mlflow.example"))
    assert "alice:***@mlflow.example" in line
    from embodyhpc.rundir import make_run_dir
    from embodyhpc.runinfo import JobRecord, RunInfo

    run = tmp_path / "runs" / "exp" / "run-1"
    assert make_run_dir(run)
    RunInfo(run_id=run.name, run_dir=str(run), backend="local", recipe=DEMO, site=None, overrides=[],
            python="/usr/bin/python3", created="2026-01-01T00:00:00+0000",
            jobs={"train": JobRecord("train", job_id="1", state="FAILED")}).save()
    line = _assert_rejected(cli("resume", str(run), f"tracking.mlflow_uri=http://alice:{VALUE}@mlflow.example"),
                            "cannot change on resume", "tracking.mlflow_uri")
    assert "alice:***@mlflow.example" in line


@pytest.mark.parametrize("uri", ["http://mlflow.example:5000", "https://mlflow.example/prefix?workspace=a",
                                 "sqlite:////tmp/mlflow.db", "databricks://profile", "http://[::1]:5000",
                                 "https://mlflow.example:5000/pkg@1.0", "ssh://git@mlflow.example/x",
                                 "http://alice@mlflow.example:5000"])
def test_uris_without_credentials_stay_allowed(cli, uri):
    result = cli("validate", DEMO, f"tracking.mlflow_uri={uri}")
    assert result.code == 0, result.err


def test_site_secrets_for_mlflow_validate(cli, tmp_path, monkeypatch):
    """The README's recipe: the login in the environment, listed in site.secrets; the URI without it."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", VALUE)
    site = _site(tmp_path, {"site": {"secrets": ["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]},
                            "tracking": {"mlflow_uri": "http://mlflow.example:5000"}})
    result = cli("validate", DEMO, "--site", str(site))
    assert result.code == 0, result.err


MASKED = [  # (text, what every message shows instead), written out by hand
    ("http://alice:pw@h:5000/x", "http://alice:***@h:5000/x"),
    ("error: 'http://alice:p@ss@h:5000': bad", "error: 'http://alice:***@h:5000': bad"),
    ("https://ghp_0123456789abcdefghijKLMN@github.com/o/r", "https://***@github.com/o/r"),
    ("s3://b/k?X-Amz-Date=1&X-Amz-Signature=abc&X-Amz-Credential=AKIA/x",
     "s3://b/k?X-Amz-Date=1&X-Amz-Signature=***&X-Amz-Credential=***"),
    ("https://a.blob.core.windows.net/c?sv=2022&sig=ab%3D", "https://a.blob.core.windows.net/c?sv=2022&sig=***"),
    ("http://h/?token=t&apiKey=k&tokenizer=x", "http://h/?token=***&apiKey=***&tokenizer=x"),
    ('["http://a/b","http://u:p@h"]', '["http://a/b","http://u:***@h"]'),
    # left alone: no credential
    ("ssh://git@github.com/o/r", "ssh://git@github.com/o/r"),
    ("https://host:5000/pkg@1.0", "https://host:5000/pkg@1.0"),
    ("docker://alice@nvcr.io#nvidia/pytorch:24.05", "docker://alice@nvcr.io#nvidia/pytorch:24.05"),
    ("model.state_key=observation.state", "model.state_key=observation.state"),
    ("http://[::1]:5000/?experiment=1", "http://[::1]:5000/?experiment=1"),
]


@pytest.mark.parametrize(("text", "shown"), MASKED, ids=[t[:40] for t, _ in MASKED])
def test_mask_credentials(text, shown):
    from embodyhpc.errors import mask_credentials

    assert mask_credentials(text) == shown


def test_one_line_errors_and_runtime_failures_mask_credentials():
    from embodyhpc.errors import ConfigError, RunFailure

    error = ConfigError(f"cannot reach 'http://alice:{VALUE}@h'", where=f"override 'x=http://a:{VALUE}@h'",
                        key="tracking.mlflow_uri", fix=f"try https://h/?token={VALUE}")
    assert VALUE not in error.one_line() and VALUE not in str(error)
    assert VALUE not in str(RunFailure(f"API request to http://alice:{VALUE}@h/api failed"))


ORDINARY = {  # schema fields whose names end in key / token / secret / password: settings, not secrets
    "model": {"state_key": "observation.environment_state", "max_token_len": 96, "tokenizer_path": "/t/tok.model"},
    "checkpoint": {"keep_latest_k": 3},
    "network": {"extra_env": {"NCCL_IB_PKEY": "0x8001", "HF_HUB_OFFLINE": "1"}},
    "eval": {"suite_options": {"video_camera": "corner"}},
}


def test_params_mask_secret_variables_and_uri_credentials_only():
    from embodyhpc.tracking.mlflow_run import flatten_params

    params = flatten_params({**ORDINARY, "site": {"env": {"HF_TOKEN": VALUE, "OMP_NUM_THREADS": "4",
                                                          "URL": f"http://a:{VALUE}@h"},
                                                  "modules": [f"https://h/?token={VALUE}"]},
                             "tracking": {"mlflow_uri": f"http://alice:{VALUE}@mlflow.example"}})
    assert VALUE not in str(params)
    assert params["site.env.HF_TOKEN"] == "***" and params["site.env.OMP_NUM_THREADS"] == "4"
    assert params["site.env.URL"] == "http://a:***@h" and params["site.modules"] == '["https://h/?token=***"]'
    assert params["tracking.mlflow_uri"] == "http://alice:***@mlflow.example"
    assert params["model.state_key"] == "observation.environment_state" and params["model.max_token_len"] == "96"
    assert params["model.tokenizer_path"] == "/t/tok.model" and params["checkpoint.keep_latest_k"] == "3"
    assert params["network.extra_env.NCCL_IB_PKEY"] == "0x8001"


def test_the_redacted_resolved_config_loads_and_runs_as_the_original(tmp_path):
    """What MLflow keeps as recipe/resolved.yaml is submit's redact() of the config: loaded again, the same config."""
    from embodyhpc.tracking.mlflow_values import redact
    from embodyhpc.validation import load_config_file

    overrides = ["model.state_key=observation.environment_state", "model.max_token_len=96",
                 "network.extra_env={NCCL_IB_PKEY: '0x8001'}", "checkpoint.keep_latest_k=3"]
    loaded = load_recipe(DEMO, overrides)
    logged = yaml.safe_dump(redact(yaml.safe_load(loaded.to_yaml())), sort_keys=False)
    assert "***" not in logged
    (tmp_path / "resolved.yaml").write_text(logged)
    assert load_config_file(tmp_path / "resolved.yaml") == loaded.config


@pytest.mark.parametrize(("override", "shown"), [
    ("model.state_key=observation.environment_state", "model.state_key=observation.environment_state"),
    ("model.max_token_len=96", "model.max_token_len=96"),
    ("site.env.HF_TOKEN=hf_x", "site.env.HF_TOKEN=***"),
    ("network.extra_env.WANDB_API_KEY=k", "network.extra_env.WANDB_API_KEY=***"),
    ("tracking.mlflow_uri=http://a:pw@h", "tracking.mlflow_uri=http://a:***@h"),
])
def test_overrides_as_mlflow_shows_them(override, shown):
    from embodyhpc.tracking.mlflow_values import redact_override

    assert redact_override(override) == shown


def test_a_secret_variable_in_an_override_is_not_echoed(cli):
    _assert_rejected(cli("validate", DEMO, f"site.env.HF_TOKEN={VALUE}"), "override 'site.env.HF_TOKEN=***'",
                     "site.secrets")


@pytest.mark.parametrize("override", ["site.extra_sbatch.comment=a;key=1", "data.delta_timestamps={action: [0.0]}",
                                      "job.name=token-key-secret", "eval.suite_options={video_camera: corner}"])
def test_text_that_is_no_uri_is_not_read_as_one(cli, override):
    result = cli("validate", DEMO, override)
    assert result.code == 0, result.err


def test_a_runs_own_resolved_yaml_is_not_refused_on_resume_but_a_new_credential_is(tmp_path):
    """resume reads what the run's jobs already read (a run submitted before this check); what it adds is checked."""
    from embodyhpc.errors import ConfigError
    from embodyhpc.validation import load_unresolved

    loaded = load_recipe(DEMO, ["tracking.mlflow_uri=http://mlflow.example:5000"])
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(loaded.to_yaml().replace("http://mlflow.example", f"http://alice:{VALUE}@mlflow.example"))
    config, _, _, _ = load_unresolved(str(resolved), ["resources.nodes=1"], recipe_site_keys="keep")
    assert config.tracking.mlflow_uri == f"http://alice:{VALUE}@mlflow.example:5000"
    with pytest.raises(ConfigError) as info:
        load_unresolved(str(resolved), [f"site.env.URL=https://bob:{VALUE}@h"], recipe_site_keys="keep")
    assert info.value.key == "site.env.URL" and VALUE not in info.value.one_line()
