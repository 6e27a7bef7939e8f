"""The chain on the real local 2-node Slurm cluster (tools/slurm-local.sh), through our CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import run_dir_from, statuses, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]  # one worker: the cluster has 2 nodes
DEMO = "recipes/smoke_cpu.yaml"
CHUNK = f"data.delta_timestamps.action=[{','.join(str(i / 10) for i in range(10))}]"  # a dataset's chunk, horizon 10


def _submit(cli, runs_root, *overrides):
    result = cli("submit", DEMO, "--site", "local", "--json", f"job.runs_root={runs_root}", *overrides)
    assert result.code == 0, result.err
    run_dir = run_dir_from(result.out)
    assert json.loads((run_dir / "run.json").read_text())["backend"] == "slurm"
    return run_dir


def _report(run_dir, timeout_s=420):  # bounds for a loaded 2-core machine, not speeds
    path = run_dir / "eval" / "report.json"
    wait_for(path.is_file, timeout_s, f"{path}")
    return json.loads(path.read_text())


def test_two_node_chain_train_eval_array_report(cli, slurm_cluster, runs_root):
    # MLflow's default store: sqlite on the runs root, the filesystem every node shares (the nodes live in their
    # own network namespaces, where a server on this host's 127.0.0.1 is out of reach)
    run_dir = _submit(cli, runs_root, "train.steps=40", "tracking.enabled=true")
    mlflow_uri = f"sqlite:///{runs_root.resolve() / 'mlflow.db'}"
    report = _report(run_dir)
    assert report["outcome"] == "complete", report
    result = json.loads((run_dir / "logs" / "train_result.json").read_text())
    # both ranks met across the two nodes: all-reduce of (rank + 1) and the gathered host names
    assert result["world_size"] == 2 and result["allreduce_sum"] == 3.0
    assert sorted(result["hostnames"]) == ["n1", "n2"]
    assert report["eval"]["shards_found"] == [0, 1, 2, 3]
    # 2 tasks x 1 seed x 2 episodes, run by both reference policies (no trained policy in the smoke recipe)
    assert report["eval"]["episodes_recorded"] == {"expert": 4, "random": 4} and report["eval"]["episodes_planned"] == 4
    assert report["results"]["policies"]["expert"]["overall"]["recorded"] == 4
    hosts = {json.loads(line)["host"] for f in (run_dir / "eval" / "shards").glob("*/shard-*.jsonl")
             for line in f.read_text().splitlines()}
    assert hosts <= {"n1", "n2"} and hosts
    # MLflow: the training run got the job's final metric and ended FINISHED; the report is its
    # child run, with metrics at the evaluated step and the plots and summary as artifacts
    from embodyhpc.tracking.mlflow_run import client, find_run

    info = json.loads((run_dir / "run.json").read_text())
    parent = wait_for(lambda: (r := find_run(mlflow_uri, info["mlflow_run_id"])) and r["status"] == "FINISHED"
                      and r, 90, "training run FINISHED in MLflow")
    assert "train/final_loss" in parent["metrics"]
    child = find_run(mlflow_uri, report["mlflow_child_run_id"])
    assert child["parent_run_id"] == info["mlflow_run_id"] and child["status"] == "FINISHED"
    assert child["metrics"]["eval/expert/success_rate"] == report["results"]["policies"]["expert"]["overall"][
        "success_rate"]
    artifacts = {a.path for a in client(mlflow_uri).list_artifacts(report["mlflow_child_run_id"], "plots")}
    # one evaluated step: no single-dot success-vs-step plot; the training's loss curve (its metrics.jsonl) instead
    assert artifacts == {"plots/task_success.png", "plots/loss.png"}
    jobs = wait_for(lambda: (s := statuses(cli, run_dir)) and all(
        j["state"] == "COMPLETED" for j in s.values()) and s, 60, "sacct to show COMPLETED")
    assert jobs["eval"]["array_counts"] == {"COMPLETED": 4}
    assert jobs["train"]["nodes"] == "n[1-2]" or wait_for(
        lambda: statuses(cli, run_dir)["train"]["nodes"] == "n[1-2]", 90, "train node list")
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
                      f"data.delta_timestamps={{action: [{chunk}]}}", "eval.enabled=false")
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
    run_dir = _submit(cli, runs_root, "data.format=lerobot", "data.root=/nonexistent/dataset", CHUNK)
    report = _report(run_dir)
    assert report["outcome"] == "train_failed"
    # exit 1 from the rank that failed, or 15 when srun's --kill-on-bad-exit ended the other rank first
    assert report["train"]["state"] == "FAILED" and report["train"]["exit_code"] not in (None, 0)
    jobs = wait_for(lambda: (s := statuses(cli, run_dir))["report"]["state"] == "COMPLETED" and s, 60,
                    "report COMPLETED in sacct")
    assert jobs["train"]["state"] == "FAILED"
    assert jobs["eval"]["state"] == "CANCELLED"
    text = cli("status", str(run_dir)).out
    assert "train_failed" in text and "FAILED" in text and "CANCELLED" in text
    logs = cli("logs", str(run_dir), "--job", "train")
    assert "/nonexistent/dataset" in logs.out


def test_cancel_stops_the_whole_chain(cli, slurm_cluster, runs_root):
    run_dir = _submit(cli, runs_root, "train.steps=100000000", "data.synthetic_step_s=0.05")
    wait_for(lambda: statuses(cli, run_dir)["train"]["state"] == "RUNNING", 180, "train RUNNING")
    result = cli("cancel", str(run_dir))
    assert result.code == 0 and "cancelled" in result.out
    jobs = wait_for(lambda: (s := statuses(cli, run_dir)) and all(
        j["state"] == "CANCELLED" for j in s.values()) and s, 60, "every job CANCELLED")
    assert set(jobs) == {"train", "eval", "report"}
    assert not (run_dir / "eval" / "report.json").exists()


@pytest.mark.slow
def test_requeued_training_resumes_and_completes(cli, slurm_cluster, runs_root):
    # at least 20 s of paced steps: the requeue, a second or two in, always finds training under way
    run_dir = _submit(cli, runs_root, "train.steps=2000", "data.synthetic_step_s=0.01", "checkpoint.every_steps=100",
                      "train.log_every=500")
    state = run_dir / "checkpoints" / "spine-state.pt"
    wait_for(state.is_file, 120, "a progress checkpoint")
    job_id = json.loads((run_dir / "run.json").read_text())["jobs"]["train"]["job_id"]
    subprocess.run(["scontrol", "requeue", job_id], check=True, capture_output=True, timeout=30)
    report = _report(run_dir, timeout_s=240)
    assert report["outcome"] == "complete", report
    result = json.loads((run_dir / "logs" / "train_result.json").read_text())
    assert result["restart_count"] >= 1
    assert 0 < result["resumed_from_step"] < 2000
    assert sorted(result["hostnames"]) == ["n1", "n2"]


# ---- preemption and time limits: USR2 -> every rank stops at one step and saves -> one requeue -> exact resume ----
def _train_job_id(run_dir) -> str:
    return json.loads((run_dir / "run.json").read_text())["jobs"]["train"]["job_id"]


def _attempts(run_dir) -> list[dict]:
    path = run_dir / "logs" / "train_attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _attempt_states(job_id: str) -> list[str]:
    """The state of every attempt of the job, oldest first (sacct --duplicates keeps requeued attempts)."""
    out = subprocess.run(["sacct", "--noheader", "--parsable2", "--allocations", "--duplicates", f"--jobs={job_id}",
                          "--format=JobID,State"], check=True, capture_output=True, text=True, timeout=30).stdout
    return [line.split("|")[1].split()[0] for line in out.splitlines() if line.split("|")[0] == job_id]


def _signal_training(run_dir) -> str:
    """Once training is under way (a progress checkpoint exists), USR2 to every task of the job, as Slurm's
    `--signal=USR2@N` does before the time limit."""
    wait_for((run_dir / "checkpoints" / "spine-state.pt").is_file, 120, "a progress checkpoint")
    job_id = _train_job_id(run_dir)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, capture_output=True, timeout=30)
    return job_id


def _stop_lines(run_dir, job_id: str) -> dict[int, str]:
    """Rank -> the step it reported stopping at, from each task's log."""
    found = {}
    for task in (0, 1):
        text = (run_dir / "submitit" / f"{job_id}_{task}_log.out").read_text()
        lines = [line for line in text.splitlines() if "received, stopping at step" in line]
        assert len(lines) == 1, (task, lines)
        found[task] = lines[0].rsplit(" ", 1)[1]
    return found


@pytest.mark.slow
def test_usr2_saves_on_every_rank_at_one_step_requeues_once_and_resumes_there(cli, slurm_cluster, runs_root):
    steps = 2000  # at least 20 s of paced steps on any machine; the signal lands within a second of step 100
    run_dir = _submit(cli, runs_root, f"train.steps={steps}", "data.synthetic_step_s=0.01",
                      "checkpoint.every_steps=100", "train.log_every=2000", "eval.enabled=false")
    job_id = _signal_training(run_dir)
    result_path = run_dir / "logs" / "train_result.json"
    wait_for(result_path.is_file, 300, "the requeued attempt to finish")
    result = json.loads(result_path.read_text())
    attempts = _attempts(run_dir)
    assert len(attempts) == 1, attempts
    stop = attempts[0]
    assert stop["outcome"] == "requeued" and stop["signal"] == "SIGUSR2" and stop["restart_count"] == 0
    assert 100 <= stop["step"] < steps
    # both ranks (one per node) agreed on the step, and the next attempt started from exactly there
    assert _stop_lines(run_dir, job_id) == {0: str(stop["step"]), 1: str(stop["step"])}
    assert result["status"] == "completed" and result["resumed_from_step"] == stop["step"]
    assert result["restart_count"] == 1 and result["steps"] == steps and result["stopped_by"] is None
    assert sorted(result["hostnames"]) == ["n1", "n2"]
    states = wait_for(lambda: (s := _attempt_states(job_id)) and s[-1] == "COMPLETED" and s, 60, "COMPLETED in sacct")
    assert states == ["REQUEUED", "COMPLETED"], "exactly one requeue"


@pytest.mark.slow
def test_usr2_stops_the_fsdp_policy_loop_on_both_nodes_and_the_requeued_job_resumes_there(
        cli, slurm_cluster, runs_root, tmp_path):
    """The real loop: pi0.5 (tiny) with FSDP2 across the two nodes, a collective DCP save at the stop step."""
    from pathlib import Path

    fixture = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "lerobot_v30_sample"
    chunk = ", ".join(str(i / 10) for i in range(10))
    steps = 40
    run_dir = _submit(cli, runs_root, f"train.steps={steps}", "data.format=lerobot", f"data.root={fixture}",
                      "train.log_every=1", "train.warmup_steps=1", "checkpoint.every_steps=1000", "eval.enabled=false",
                      f"data.delta_timestamps={{action: [{chunk}]}}", "tracking.enabled=true")
    metrics_path = run_dir / "logs" / "metrics.jsonl"
    wait_for(lambda: metrics_path.is_file() and len(metrics_path.read_text().splitlines()) >= 2, 180,
             "two logged training steps")
    job_id = _train_job_id(run_dir)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, capture_output=True, timeout=30)
    result_path = run_dir / "logs" / "train_result.json"
    wait_for(result_path.is_file, 300, "the requeued attempt to finish")
    attempts = _attempts(run_dir)
    assert [(a["outcome"], a["signal"]) for a in attempts] == [("requeued", "SIGUSR2")]
    stop = attempts[0]["step"]
    assert 2 <= stop < steps
    result = json.loads(result_path.read_text())
    assert result["mode"] == "policy" and result["status"] == "completed" and result["restart_count"] == 1
    assert result["resumed_from_step"] == stop and result["steps"] == steps
    marker = json.loads((run_dir / "checkpoints" / f"step-{stop}" / ".complete").read_text())
    assert marker["step"] == stop and marker["world_size"] == 2 and marker["async"] is False
    # one continuous curve: every step logged once, the resumed attempt continuing after the stop step
    assert [json.loads(line)["step"] for line in metrics_path.read_text().splitlines()] == list(range(1, steps + 1))
    assert Path(result["export_path"]).exists()
    states = wait_for(lambda: (s := _attempt_states(job_id)) and s[-1] == "COMPLETED" and s, 60, "COMPLETED in sacct")
    assert states == ["REQUEUED", "COMPLETED"]
    # MLflow holds the same single curve: the requeued attempt continued the run, which ended FINISHED
    from embodyhpc.tracking.mlflow_run import client, find_run

    uri = f"sqlite:///{runs_root.resolve() / 'mlflow.db'}"
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    history = client(uri).get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, steps + 1))
    assert find_run(uri, run_id)["status"] == "FINISHED"


@pytest.mark.slow
def test_the_time_limit_signal_from_sbatch_requeues_until_training_completes(cli, slurm_cluster, runs_root):
    """No scancel: `#SBATCH --time=2 --signal=USR2@60` itself. Slurm fires the signal 20-60 s into each attempt
    (FACTS: up to ~40 s early), so the number of attempts varies; every one must resume where the last stopped."""
    # at least 70 s of paced steps on any machine, however fast: more than an attempt lasts before its signal
    steps = 1400
    run_dir = _submit(cli, runs_root, f"train.steps={steps}", "data.synthetic_step_s=0.05",
                      "checkpoint.every_steps=100", "train.log_every=100000", "eval.enabled=false", "resources.time=2",
                      "resources.signal_delay_s=60", "resources.max_requeues=6")
    job_id = _train_job_id(run_dir)
    result_path = run_dir / "logs" / "train_result.json"
    wait_for(result_path.is_file, 540, "training to complete across time-limited attempts")
    result = json.loads(result_path.read_text())
    attempts = _attempts(run_dir)
    assert attempts and all(a["outcome"] == "requeued" and a["signal"] == "SIGUSR2" for a in attempts), attempts
    assert [a["restart_count"] for a in attempts] == list(range(len(attempts)))
    # each attempt started where the one before stopped, and the last one finished the run from there
    assert [a["resumed_from_step"] for a in attempts[1:]] == [a["step"] for a in attempts[:-1]]
    assert result["status"] == "completed" and result["resumed_from_step"] == attempts[-1]["step"]
    assert result["restart_count"] == len(attempts) and result["steps"] == steps
    states = wait_for(lambda: (s := _attempt_states(job_id)) and s[-1] == "COMPLETED" and s, 60, "COMPLETED in sacct")
    assert states == ["REQUEUED"] * len(attempts) + ["COMPLETED"]


def test_usr2_beyond_the_retry_limit_fails_the_job_and_says_why(cli, slurm_cluster, runs_root):
    run_dir = _submit(cli, runs_root, "train.steps=100000000", "data.synthetic_step_s=0.01",
                      "checkpoint.every_steps=100", "train.log_every=100000", "eval.enabled=false",
                      "resources.max_requeues=0")
    job_id = _signal_training(run_dir)
    result_path = run_dir / "logs" / "train_result.json"
    wait_for(result_path.is_file, 120, "the failure to be recorded")
    result = json.loads(result_path.read_text())
    stop = _attempts(run_dir)
    assert [a["outcome"] for a in stop] == ["failed"]
    step = stop[0]["step"]
    assert result["status"] == "failed" and result["stopped_at_step"] == step
    assert "resources.max_requeues=0" in result["error"] and f"step {step}" in result["error"]
    # the state of that step was saved all the same (the spine's progress checkpoint)
    import torch

    assert int(torch.load(run_dir / "checkpoints" / "spine-state.pt")["step"]) == step
    # slurmdbd can lag slurmctld: until the job's start and end reach it, sacct may still say PENDING or RUNNING
    states = wait_for(lambda: (s := _attempt_states(job_id)) and s[-1] not in ("PENDING", "CONFIGURING", "RUNNING",
                                                                                 "COMPLETING") and s, 60,
                      "the job to end in sacct")
    assert states == ["FAILED"]
    wait_for(lambda: "TrainingStopped" in (run_dir / "submitit" / f"{job_id}_0_log.err").read_text(), 30,
             "the error in the job log")
    assert "resources.max_requeues=0" in (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()
