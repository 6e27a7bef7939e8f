"""`cancel` on the real local cluster: everything a run started, evaluation chains included, and nothing else."""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_dir_from, statuses, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]  # one worker: the cluster has 2 nodes
DEMO = "recipes/smoke_cpu.yaml"
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"}


def _submit(cli, runs_root, name):
    result = cli("submit", DEMO, "--site", "local", "--json", f"job.runs_root={runs_root}", f"job.name={name}",
                 "train.steps=100000000", "data.synthetic_step_s=0.05")  # sleeps, not spins, until cancelled
    assert result.code == 0, result.err
    return run_dir_from(result.out)


def test_cancel_reaches_the_evaluation_chains_of_the_run_and_nothing_else(cli, slurm_cluster, runs_root):
    run, evaluation, bystander = (_submit(cli, runs_root, name) for name in ("run", "evaluation", "bystander"))
    # an evaluation chain the training job submitted: a run.json under <run>/evals/step-N naming real jobs
    data = json.loads((evaluation / "run.json").read_text())
    data["parent_run"] = str(run)
    (run / "evals" / "step-100").mkdir(parents=True)
    (run / "evals" / "step-100" / "run.json").write_text(json.dumps(data))
    try:
        result = cli("cancel", str(run))
        assert result.code == 0 and "cancelled evaluation step-100" in result.out, result.err
        for folder in (run, evaluation):
            wait_for(lambda folder=folder: all(j["state"] == "CANCELLED" for j in statuses(cli, folder).values()),
                     60, f"every job of {folder.name} CANCELLED")
        assert all(j["state"] in ACTIVE for j in statuses(cli, bystander).values())
    finally:
        cli("cancel", str(bystander))
        cli("cancel", str(evaluation))
