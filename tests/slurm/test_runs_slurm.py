"""`runs` and `status --watch` on the real local cluster: a Slurm run's state comes from sacct/squeue, its training
progress from the metrics file the job writes on the shared runs root, and --watch ends when the chain does."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_dir_from, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]  # one worker: the cluster has 2 nodes
DEMO = "recipes/smoke_cpu.yaml"


def _runs(cli, runs_root) -> dict[str, dict]:
    result = cli("runs", "--runs-root", str(runs_root), "--json")
    assert result.code == 0, result.err
    return {row["name"].split("/")[1]: row for row in json.loads(result.out)["runs"]}


def test_runs_and_watch_follow_a_real_slurm_run(cli, slurm_cluster, runs_root):
    long = run_dir_from(cli("submit", DEMO, "--site", "local", "--json", f"job.runs_root={runs_root}",
                            "job.name=long", "train.steps=100000000", "data.synthetic_step_s=0.05").out)
    short = run_dir_from(cli("submit", DEMO, "--site", "local", "--json", f"job.runs_root={runs_root}",
                             "job.name=short", "train.steps=2000", "eval.enabled=false").out)
    try:
        # the long one trains: RUNNING (train) in sacct/squeue, and its steps grow in the metrics file
        row = wait_for(lambda: (r := _runs(cli, runs_root)[long.name])["state"] == "RUNNING" and r["step"] and r,
                       120, "the long run RUNNING with a logged step")
        assert row["job"] == "train" and row["total_steps"] == 100000000 and row["backend"] == "slurm"
        status = json.loads(cli("status", long.name, "--runs-root", str(runs_root), "--json").out)
        assert status["states_from"] == "slurm" and status["progress"]["eta_s"] > 0
        # --watch of the short one (found by name) ends with its chain
        watched = cli("status", short.name.rsplit("-", 2)[0] + "-", "--runs-root", str(runs_root),
                      "--watch", "--interval", "1")
        assert watched.code == 0, (watched.out, watched.err)
        assert "COMPLETED: step 2000/2000 (100%)" in watched.out
        assert _runs(cli, runs_root)[short.name]["state"] == "COMPLETED"
        assert [r["state"] for r in json.loads(cli("runs", "--runs-root", str(runs_root), "--state", "completed",
                                                   "--json").out)["runs"]] == ["COMPLETED"]
    finally:
        cli("cancel", str(long))
    wait_for(lambda: _runs(cli, runs_root)[long.name]["state"] == "CANCELLED", 60, "the long run CANCELLED")
