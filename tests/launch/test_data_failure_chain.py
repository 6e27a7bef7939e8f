"""`embodyhpc submit --local` on a dataset whose metadata is fine (validate passes) but whose video is truncated: the
training job fails within a bound instead of hanging on its DataLoader workers (they ignore SIGTERM, so the job
used to wait for them until they were SIGKILLed 15 minutes later), the command exits 1, and run.json, `status`,
logs/train_result.json and MLflow all say FAILED with the worker's error. With data.on_bad_sample=skip the same run
trains on and MLflow has the count of skipped samples.

The command runs in its own session with a hard timeout: a hang fails the test and its processes are killed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import run_dir_from

pytestmark = pytest.mark.slow  # a local chain: 2 training processes with 2 DataLoader workers each

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "data" / "fixtures" / "lerobot_v30_sample"
TOP = "videos/observation.images.top/chunk-000/file-000.mp4"
CHUNK = "{action: [" + ", ".join(str(i / 10) for i in range(10)) + "]}"  # model.action_horizon 10 of smoke_cpu
BOUND_S = 240  # the whole chain; the hang this guards against lasted 15 minutes
TRAIN = ("resources.nodes=1", "resources.tasks_per_node=2", "data.format=lerobot", f"data.delta_timestamps={CHUNK}",
         "data.num_workers=2", "train.global_batch_size=8", "train.micro_batch_size=2", "train.warmup_steps=1",
         "train.log_every=1", "eval.enabled=false", "tracking.enabled=true")


def _embodyhpc(*args: str, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI in a session of its own (the local chain's processes join it), killed whole after `timeout_s`."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "embodyhpc.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"`embodyhpc {' '.join(args[:2])}` still running after {timeout_s} s: {err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - started


def _left_behind(run: Path) -> list[str]:
    """Processes still running with the run's folder on their command line (the chain's, a worker's)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if str(run) in line]


@pytest.fixture
def truncated_dataset(tmp_path) -> tuple[Path, Path]:
    root = tmp_path / "data"
    shutil.copytree(FIXTURE, root)
    video = root / TOP
    video.chmod(0o644)
    video.write_bytes(video.read_bytes()[: video.stat().st_size // 2])  # episodes 2 and 3 lose their frames
    return root, video


def _mlflow_run(runs_root: Path, run_id: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{runs_root / 'mlflow.db'}").get_run(run_id)


def test_a_truncated_video_fails_the_chain_with_the_workers_error_everywhere(tmp_path, truncated_dataset):
    root, video = truncated_dataset
    runs_root = tmp_path / "runs"
    result, took_s = _embodyhpc("submit", "recipes/smoke_cpu.yaml", "--local", "--json", f"job.runs_root={runs_root}",
                                f"data.root={root}", "train.steps=40", *TRAIN, timeout_s=BOUND_S)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "train FAILED (" in errors[0] and f"SampleError: {video}" in errors[0], errors

    run = run_dir_from(result.stdout)
    info = json.loads((run / "run.json").read_text())
    train = info["jobs"]["train"]
    assert train["state"] == "FAILED" and train["exit_code"] == 1
    assert "DataWorkerError: rank " in train["reason"] and f"SampleError: {video}" in train["reason"]

    recorded = json.loads((run / "logs" / "train_result.json").read_text())
    assert recorded["status"] == "failed" and "\n" not in recorded["error"]
    assert f"SampleError: {video}: episode " in recorded["error"] and ", frame " in recorded["error"]

    status, _ = _embodyhpc("status", str(run), "--json", timeout_s=60)
    assert status.returncode == 0, status.stderr
    (train_status,) = [job for job in json.loads(status.stdout)["jobs"] if job["kind"] == "train"]
    assert train_status["state"] == "FAILED" and f"SampleError: {video}" in train_status["reason"]

    listed, _ = _embodyhpc("runs", "--runs-root", str(runs_root), "--json", timeout_s=60)
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)["runs"]
    assert row["state"] == "FAILED" and row["job"] == "train" and f"SampleError: {video}" in row["reason"]

    mlflow_run = _mlflow_run(runs_root, info["mlflow_run_id"])
    assert mlflow_run.info.status == "FAILED"
    reason = mlflow_run.data.tags["embodyhpc.failure_reason"]
    assert reason.startswith("DataWorkerError: rank ") and f"SampleError: {video}: episode " in reason

    assert _left_behind(run) == []  # no training process, no DataLoader worker outlived the chain
    assert took_s < BOUND_S


def test_with_skip_the_run_trains_on_and_mlflow_counts_the_skipped_samples(tmp_path, truncated_dataset):
    root, _ = truncated_dataset
    runs_root = tmp_path / "runs"
    result, _ = _embodyhpc("submit", "recipes/smoke_cpu.yaml", "--local", "--json", f"job.runs_root={runs_root}",
                           f"data.root={root}", "train.steps=6", "data.on_bad_sample=skip", *TRAIN, timeout_s=BOUND_S)
    assert result.returncode == 0, result.stderr[-3000:]
    run = run_dir_from(result.stdout)
    info = json.loads((run / "run.json").read_text())
    assert info["jobs"]["train"]["state"] == "COMPLETED"
    assert json.loads((run / "logs" / "train_result.json").read_text())["status"] == "completed"
    metrics = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    counts = [m["data_skipped_samples"] for m in metrics]
    assert counts == sorted(counts) and counts[-1] > 0  # a running total over both ranks
    mlflow_run = _mlflow_run(runs_root, info["mlflow_run_id"])
    assert mlflow_run.data.metrics["train/data_skipped_samples"] == counts[-1]
    log = "".join(p.read_text() for p in (run / "submitit").glob("*_log.err"))
    assert "skipped a bad sample (data.on_bad_sample=skip): sample " in log
    assert _left_behind(run) == []
