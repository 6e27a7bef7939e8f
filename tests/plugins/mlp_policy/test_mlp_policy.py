"""A model added from this folder alone: installed as an `embodyhpc.models` entry point (a dist-info written
under tmp, put on PYTHONPATH with the repository), validated with its own options, and run through a local
train -> eval -> report chain by the real command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from embodyhpc.errors import ConfigError
from embodyhpc.validation import load_recipe
from tests.helpers import run_dir_from

pytestmark = pytest.mark.sim  # steps a simulator

REPO = Path(__file__).resolve().parents[3]


def install_entry_point(site: Path) -> Path:
    dist = site / "mlp_policy_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mlp-policy-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[embodyhpc.models]\nmlp = tests.plugins.mlp_policy:SPEC\n")
    return site


@pytest.fixture
def plugin_env(tmp_path, monkeypatch) -> dict[str, str]:
    """The entry point for this process (sys.path) and for every process the chain starts (PYTHONPATH)."""
    site = install_entry_point(tmp_path / "site")
    monkeypatch.syspath_prepend(str(site))
    paths = [str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "MLFLOW_DISABLE_TELEMETRY": "true"}


def write_recipe(path: Path, runs: Path, data: Path, **model_options) -> Path:
    recipe = {
        "job": {"name": "mlp-plugin", "experiment": "plugins", "runs_root": str(runs)},
        "resources": {"nodes": 1, "gpus_per_node": 0, "tasks_per_node": 1, "cpus_per_task": 1, "mem": "2G",
                      "time": "00:10:00"},
        "data": {"format": "lerobot", "root": str(data), "num_workers": 0,
                 "delta_timestamps": {"action": [i / 80 for i in range(4)]}},
        "model": {"name": "mlp", "action_horizon": 4, "action_dim": 4, "state_key": "observation.environment_state",
                  "state_norm": "mean_std", "options": model_options},
        "train": {"steps": 30, "global_batch_size": 8, "micro_batch_size": 8, "lr": 1.0e-3, "warmup_steps": 2,
                  "log_every": 10},
        "precision": {"mode": "fp32"},
        "checkpoint": {"every_steps": 30, "keep_latest_k": 2},
        "eval": {"suite": "metaworld", "tasks": ["reach-v3"], "seeds": [100], "episodes_per_task": 2, "shards": 1,
                 "array_parallelism": 1, "cpus_per_task": 1, "mem": "2G", "time": "00:10:00", "max_steps": 20,
                 "execute_steps": 2, "reference_policies": ["random"], "videos_per_task": 0},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


def embodyhpc(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embodyhpc.cli.main", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=900)


def test_the_registry_finds_it_and_validate_checks_its_options(plugin_env, tmp_path):
    # a dataset on a filesystem this machine does not mount: validate warns and leaves it to the job (a folder
    # here would have to be a dataset that fits the recipe: validation/data_checks.py reads it)
    recipe = write_recipe(tmp_path / "mlp.yaml", tmp_path / "runs", Path("/nonexistent-fs-embodyhpc/mlp-data"),
                          hidden_width=16)
    config = load_recipe(str(recipe)).config
    assert config.model.name == "mlp" and config.model.options == {"hidden_width": 16}
    from embodyhpc.models import available_models, model_spec

    assert {"groot", "mlp", "pi05"} <= set(available_models())  # the shipped families and this one
    assert model_spec("mlp").parse_options(config.model.options).hidden_width == 16
    with pytest.raises(ConfigError, match=r"model.options.num_layers: the mlp model has no option 'num_layers'"):
        load_recipe(str(recipe), ["model.options.num_layers=3"])
    with pytest.raises(ConfigError, match=r"model.options.hidden_width: wrong type: expected an integer"):
        load_recipe(str(recipe), ["model.options.hidden_width=wide"])
    # the same through the command line, in a process that only has the entry point: one line, exit 2
    result = embodyhpc(plugin_env, "validate", str(recipe), "model.options.hidden_width=0", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "model.options.hidden_width: must be >= 1, got 0" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert embodyhpc(plugin_env, "validate", str(recipe), cwd=tmp_path).returncode == 0


def test_without_the_entry_point_the_name_is_refused(tmp_path):
    recipe = write_recipe(tmp_path / "mlp.yaml", tmp_path / "runs", tmp_path / "data")
    with pytest.raises(ConfigError, match=r"model.name: unknown model 'mlp'; registered: ") as caught:
        load_recipe(str(recipe))
    registered = str(caught.value).split("registered: ")[1].split(" (")[0].split(", ")
    assert {"groot", "pi05"} <= set(registered) and "mlp" not in registered


@pytest.mark.slow
def test_a_local_chain_trains_evaluates_and_reports_it(plugin_env, tmp_path):
    data = tmp_path / "data"
    synth = embodyhpc(plugin_env, "data", "synth", "--out", str(data), "--tasks", "reach-v3", "--episodes", "4",
                      "--cameras", "", cwd=tmp_path)
    assert synth.returncode == 0, synth.stderr
    recipe = write_recipe(tmp_path / "mlp.yaml", tmp_path / "runs", data, hidden_width=32, num_blocks=2)
    result = embodyhpc(plugin_env, "submit", str(recipe), "--local", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = run_dir_from(result.stdout)
    info = json.loads((run_dir / "run.json").read_text())
    assert {kind: job["state"] for kind, job in info["jobs"].items()} == {
        "train": "COMPLETED", "eval": "COMPLETED", "report": "COMPLETED"}
    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [10, 20, 30] and metrics[-1]["loss"] < metrics[0]["loss"]
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete", report["why"]
    policies = report["results"]["policies"]
    assert set(policies) == {"trained", "random"}
    assert policies["trained"]["overall"]["recorded"] == 2
    # the export holds this model's tensors, not pi0.5's
    from safetensors import safe_open

    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as weights:
        assert sorted(weights.keys())[:2] == ["blocks.0.0.bias", "blocks.0.0.weight"]
