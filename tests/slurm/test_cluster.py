"""The chain on the real local 2-node Slurm cluster (tools/slurm-local.sh), through our CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import run_dir_from, statuses, wait_for

pytestmark = pytest.mark.slurm
DEMO = "recipes/demo_metaworld_cpu.yaml"


def _submit(cli, runs_root, *overrides):
    result = cli("submit", DEMO, "--site", "local", "--json", f"job.runs_root={runs_root}", *overrides)
    assert result.code == 0, result.err
    run_dir = run_dir_from(result.out)
    assert json.loads((run_dir / "run.json").read_text())["backend"] == "slurm"
    return run_dir


def _report(run_dir, timeout_s=180):
    path = run_dir / "eval" / "report.json"
    wait_for(path.is_file, timeout_s, f"{path}")
    return json.loads(path.read_text())


def test_two_node_chain_train_eval_array_report(cli, slurm_cluster, runs_root):
    run_dir = _submit(cli, runs_root, "train.steps=40")
    report = _report(run_dir)
    assert report["outcome"] == "complete", report
    result = json.loads((run_dir / "logs" / "train_result.json").read_text())
    # both ranks met across the two nodes: all-reduce of (rank + 1) and the gathered host names
    assert result["world_size"] == 2 and result["allreduce_sum"] == 3.0
    assert sorted(result["hostnames"]) == ["n1", "n2"]
    assert report["eval"]["shards_found"] == [0, 1, 2, 3]
    assert report["eval"]["episodes_recorded"] == report["eval"]["episodes_planned"] == 20
    hosts = {json.loads(line)["host"] for f in (run_dir / "eval").glob("shard-*.jsonl")
             for line in f.read_text().splitlines()}
    assert hosts <= {"n1", "n2"}
    jobs = wait_for(lambda: (s := statuses(cli, run_dir)) and all(
        j["state"] == "COMPLETED" for j in s.values()) and s, 60, "sacct to show COMPLETED")
    assert jobs["eval"]["array_counts"] == {"COMPLETED": 4}
    assert jobs["train"]["nodes"] == "n[1-2]" or wait_for(
        lambda: statuses(cli, run_dir)["train"]["nodes"] == "n[1-2]", 30, "train node list")
    text = cli("status", str(run_dir)).out
    assert "report: complete" in text and "4/4 done" in text
    # -f returns once the job has ended, after printing every task's output
    followed = cli("logs", str(run_dir), "--job", "train", "-f")
    assert followed.code == 0 and "[train task 0 out]" in followed.out and "[train task 1 out]" in followed.out
    assert "step 40/40" in followed.out


def test_submitted_text_is_rendered_text(cli, slurm_cluster, runs_root):
    """What sbatch received (submitit's copy) == scripts/ in the run dir == `embodyhpc render`."""
    run_dir = _submit(cli, runs_root, "train.steps=5")
    info = json.loads((run_dir / "run.json").read_text())
    for kind in ("train", "eval", "report"):
        job_id = info["jobs"][kind]["job_id"]
        submitted = (run_dir / "submitit" / f"{job_id}_submission.sh").read_text()
        assert submitted == (run_dir / "scripts" / f"{kind}.sbatch").read_text()
        rendered = cli("render", DEMO, "--site", "local", f"job.runs_root={runs_root}", "train.steps=5",
                       "--job", kind, "--run-dir", str(run_dir))
        assert rendered.code == 0 and rendered.out == submitted, kind
    assert info["python"] == sys.executable
    _report(run_dir)


def test_policy_trains_on_a_dataset_staged_to_each_node(cli, slurm_cluster, runs_root, tmp_path):
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "lerobot_v30_sample"
    nvme = tmp_path / "nvme"
    chunk = ", ".join(str(i / 10) for i in range(10))  # model.action_horizon 10 at the sample's 10 fps
    run_dir = _submit(cli, runs_root, "train.steps=3", "data.format=lerobot", f"data.root={fixture}",
                      "staging.enabled=true", f"staging.nvme_dir={nvme}", "train.log_every=1", "train.warmup_steps=1",
                      f"data.delta_timestamps={{action: [{chunk}]}}")
    assert _report(run_dir, timeout_s=300)["outcome"] == "complete"
    result = json.loads((run_dir / "logs" / "train_result.json").read_text())
    # pi0.5 (tiny) trained with FSDP2 across both nodes on the staged copy, checkpointed and exported
    assert result["mode"] == "policy" and result["steps"] == 3 and sorted(result["hostnames"]) == ["n1", "n2"]
    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["loss"] > 0 for m in metrics)
    assert (run_dir / "checkpoints" / "step-3" / ".complete").is_file()
    assert Path(result["export_path"]).exists()
    staged = Path(result["data_root"])
    assert staged.parent == nvme and (staged / ".embodyhpc-stage.json").is_file()
    assert sorted(p.name for p in (staged / "meta").iterdir()) == sorted(p.name for p in (fixture / "meta").iterdir())


def test_failed_training_cancels_eval_and_report_says_why(cli, slurm_cluster, runs_root):
    run_dir = _submit(cli, runs_root, "data.format=lerobot", "data.root=/nonexistent/dataset")
    report = _report(run_dir)
    assert report["outcome"] == "train_failed"
    assert report["train"]["state"] == "FAILED" and report["train"]["exit_code"] == 1
    jobs = wait_for(lambda: (s := statuses(cli, run_dir))["report"]["state"] == "COMPLETED" and s, 60,
                    "report COMPLETED in sacct")
    assert jobs["train"]["state"] == "FAILED"
    assert jobs["eval"]["state"] == "CANCELLED"
    text = cli("status", str(run_dir)).out
    assert "train_failed" in text and "FAILED" in text and "CANCELLED" in text
    logs = cli("logs", str(run_dir), "--job", "train")
    assert "/nonexistent/dataset" in logs.out


def test_cancel_stops_the_whole_chain(cli, slurm_cluster, runs_root):
    run_dir = _submit(cli, runs_root, "train.steps=100000000")
    wait_for(lambda: statuses(cli, run_dir)["train"]["state"] == "RUNNING", 60, "train RUNNING")
    result = cli("cancel", str(run_dir))
    assert result.code == 0 and "cancelled" in result.out
    jobs = wait_for(lambda: (s := statuses(cli, run_dir)) and all(
        j["state"] == "CANCELLED" for j in s.values()) and s, 60, "every job CANCELLED")
    assert set(jobs) == {"train", "eval", "report"}
    assert not (run_dir / "eval" / "report.json").exists()


@pytest.mark.slow
def test_requeued_training_resumes_and_completes(cli, slurm_cluster, runs_root):
    run_dir = _submit(cli, runs_root, "train.steps=4000", "checkpoint.every_steps=100", "train.log_every=500")
    state = run_dir / "checkpoints" / "spine-state.pt"
    wait_for(state.is_file, 120, "a progress checkpoint")
    job_id = json.loads((run_dir / "run.json").read_text())["jobs"]["train"]["job_id"]
    subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, timeout=30)
    report = _report(run_dir, timeout_s=240)
    assert report["outcome"] == "complete", report
    result = json.loads((run_dir / "logs" / "train_result.json").read_text())
    assert result["restart_count"] >= 1
    assert 0 < result["resumed_from_step"] < 4000
    assert sorted(result["hostnames"]) == ["n1", "n2"]
