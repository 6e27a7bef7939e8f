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
from embodyhpc.config.load import load_recipe
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
