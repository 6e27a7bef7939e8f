"""An evaluation shard with eval.envs_per_shard > 1 (embodyhpc.eval.vector) writes the records the one-env shard
writes: the same episodes, outcomes and order, for every reference row."""

from __future__ import annotations

import json

import pytest

from embodyhpc.launch.eval import eval_shard_task, shard_file
from embodyhpc.orchestrate.api import start_run
from embodyhpc.rundir import make_run_dir
from embodyhpc.validation import load_recipe
from tests.helpers import require

pytestmark = pytest.mark.sim  # steps a simulator

TIMING = ("wall_s", "host", "shard_started_at", "video")  # which episode's film is kept depends on finishing order


def shard_records(tmp_path, envs: int, capsys) -> dict[str, list[dict]]:
    loaded = load_recipe("smoke_cpu", [f"job.runs_root={tmp_path}", "eval.shards=1", "eval.episodes_per_task=3",
                                       "eval.max_steps=30", f"eval.envs_per_shard={envs}",
                                       f"eval.cpus_per_task={envs}"])
    run = tmp_path / f"envs-{envs}"
    assert make_run_dir(run)
    start_run(loaded, run, backend="local", python="/venv/bin/python", mlflow_run_id=None)
    result = eval_shard_task(str(run), 0)
    assert result["episodes"] == 6
    assert {row["num_envs"] for row in result["policies"].values()} == {envs}
    assert f"{envs} env(s) at once" in capsys.readouterr().out
    return {name: [{k: v for k, v in json.loads(line).items() if k not in TIMING}
                   for line in shard_file(run, name, 0).read_text().splitlines()]
            for name in ("expert", "random")}


@pytest.mark.slow
def test_a_shard_of_three_envs_writes_what_a_shard_of_one_writes(tmp_path, capsys):
    require("metaworld", "sim")
    one, three = shard_records(tmp_path, 1, capsys), shard_records(tmp_path, 3, capsys)
    assert three == one
    assert [r["task"] for r in three["expert"]] == ["reach-v3"] * 3 + ["drawer-open-v3"] * 3
    assert len({r["return"] for r in three["expert"]}) == 6  # six different episodes, not one repeated
