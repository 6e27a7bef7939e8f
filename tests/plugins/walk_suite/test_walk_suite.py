"""A suite added from this folder alone, as an `embodyhpc.eval_suites` entry point (a dist-info written under tmp,
on PYTHONPATH with the repository): validate accepts its name, options and task names and refuses others, `data
synth` records its expert, and a local train -> eval -> report chain evaluates the reference policies in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embodyhpc.errors import ConfigError
from embodyhpc.validation import load_recipe
from tests.helpers import run_dir_from

REPO = Path(__file__).resolve().parents[3]
WALK = ["eval.suite=walk", "eval.tasks=[walk-near,walk-far]"]


@pytest.fixture
def plugin_env(tmp_path, monkeypatch) -> dict[str, str]:
    site = tmp_path / "site"
    dist = site / "walk_suite_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: walk-suite-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[embodyhpc.eval_suites]\nwalk = tests.plugins.walk_suite:WalkSuite\n")
    monkeypatch.syspath_prepend(str(site))
    paths = [str(site), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "MLFLOW_DISABLE_TELEMETRY": "true"}


def embodyhpc(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embodyhpc.cli.main", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=900)


def test_validate_reads_its_name_options_and_task_names(plugin_env, tmp_path):
    config = load_recipe("smoke_cpu", [*WALK, "eval.suite_options.limit=10"]).config
    assert (config.eval.suite, config.eval.tasks, config.eval.suite_options) == (
        "walk", ["walk-near", "walk-far"], {"limit": 10})
    with pytest.raises(ConfigError, match=r"eval.tasks: 'walk-farther' is not a task of the walk suite "
                                          r"\(fix: did you mean 'walk-far'\?\)"):
        load_recipe("smoke_cpu", ["eval.suite=walk", "eval.tasks=[walk-farther]"])
    with pytest.raises(ConfigError, match=r"eval.suite_options.speed: the walk suite has no option 'speed'"):
        load_recipe("smoke_cpu", [*WALK, "eval.suite_options.speed=2"])
    result = embodyhpc(plugin_env, "validate", "smoke_cpu", "eval.suite=walk", "eval.tasks=[nope]", cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "eval.tasks: 'nope' is not a task of the walk suite" in result.stderr
    assert embodyhpc(plugin_env, "validate", "smoke_cpu", *WALK, cwd=tmp_path).returncode == 0


def test_without_the_entry_point_the_suite_is_refused():
    with pytest.raises(ConfigError, match=r"eval.suite"):
        load_recipe("smoke_cpu", WALK)


@pytest.mark.slow
def test_data_synth_and_a_local_chain_run_in_it(plugin_env, tmp_path):
    synth = embodyhpc(plugin_env, "data", "synth", "--env", "walk", "--tasks", "walk-near", "--episodes", "2",
                      "--out", str(tmp_path / "demos"), cwd=tmp_path)
    assert synth.returncode == 0, synth.stderr
    info = json.loads((tmp_path / "demos" / "meta" / "info.json").read_text())
    assert info["total_episodes"] == 2 and info["features"]["observation.state"]["shape"] == [2]
    result = embodyhpc(plugin_env, "submit", "smoke_cpu", "--local", "--json", *WALK, "resources.nodes=1",
                       "train.steps=4", "train.log_every=2", "checkpoint.every_steps=4", "eval.shards=2",
                       f"job.runs_root={tmp_path / 'runs'}", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = run_dir_from(result.stdout)
    states = {kind: job["state"] for kind, job in json.loads((run_dir / "run.json").read_text())["jobs"].items()}
    assert states == {"train": "COMPLETED", "eval": "COMPLETED", "report": "COMPLETED"}
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete", report["why"]
    overall = {name: p["overall"] for name, p in report["results"]["policies"].items()}
    assert set(overall) == {"expert", "random"}
    assert overall["expert"]["recorded"] == 4 and overall["expert"]["success_rate"] == 1.0
