"""`submit --local`: the same chain on this machine (2 training processes over gloo)."""

from __future__ import annotations

import json

import pytest

from embodyhpc.rundir import LOCK_FILE
from tests.helpers import run_dir_from, statuses

DEMO = "recipes/smoke_cpu.yaml"
CHUNK = f"data.delta_timestamps.action=[{','.join(str(i / 10) for i in range(10))}]"  # a dataset's chunk, horizon 10


@pytest.mark.slow
def test_local_chain_completes(cli, runs_root):
    result = cli("submit", DEMO, "--local", "--json", f"job.runs_root={runs_root}", "train.steps=30")
    assert result.code == 0, result.err
    run_dir = run_dir_from(result.out)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        LOCK_FILE, "checkpoints", "eval", "logs", "resolved.yaml", "run.json", "scripts", "submitit"]
    train = json.loads((run_dir / "logs" / "train_result.json").read_text())
    assert train["world_size"] == 2 and train["allreduce_sum"] == 3.0 and train["steps"] == 30
    jobs = statuses(cli, run_dir)
    assert [jobs[k]["state"] for k in ("train", "eval", "report")] == ["COMPLETED"] * 3
    assert jobs["eval"]["array_counts"] == {"COMPLETED": 4}
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete" and report["eval"]["episodes_recorded"] == {"expert": 4, "random": 4}
    assert report["results"]["policies"]["expert"]["overall"]["success_rate"] is not None
    assert (run_dir / "eval" / "report.md").is_file() and (run_dir / "eval" / "plots" / "task_success.png").is_file()
    text = cli("status", str(run_dir)).out
    assert "(local;" in text and "report: complete" in text
    logs = cli("logs", str(run_dir), "--job", "train").out
    assert "step 30/30" in logs


@pytest.mark.slow
def test_local_failed_training_skips_eval_and_reports(cli, runs_root):
    result = cli("submit", DEMO, "--local", "--json", f"job.runs_root={runs_root}",
                 "data.format=hdf5", "data.root=/nonexistent/demos.hdf5", CHUNK)
    assert result.code == 1 and "train FAILED" in result.err, result.err
    jobs = statuses(cli, run_dir_from(result.out))
    assert jobs["train"]["state"] == "FAILED" and "/nonexistent/demos.hdf5" in jobs["train"]["reason"]
    assert jobs["eval"]["state"] == "CANCELLED"
    assert jobs["report"]["state"] == "COMPLETED"


def test_unreachable_slurm_falls_back_to_local_with_a_message(cli, runs_root, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch
    from embodyhpc import submit as submitting

    calls = []
    # LocalBackend.submit(self, plan, info): the chain is not run, the RunInfo it was handed is returned
    monkeypatch.setattr("embodyhpc.orchestrate.backend_local.LocalBackend.submit",
                        lambda *a, **k: calls.append(a) or a[2])
    result = cli("submit", DEMO, f"job.runs_root={runs_root}")
    assert result.code == 0, result.err
    assert "no Slurm cluster reachable" in result.out and "--local" in result.out
    assert len(calls) == 1 and calls[0][2].backend == "local"
    assert submitting  # imported for the monkeypatch target
