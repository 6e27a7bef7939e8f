"""`embodyhpc resume` on the real 2-node cluster: a 2-node run cancelled after a checkpoint goes on on 1 node, then
trains on with more steps; one MLflow curve, every attempt in `status`; and a run whose job still runs is refused."""

from __future__ import annotations

import json

import pytest

from embodyhpc.checkpoint import layout
from embodyhpc.runinfo import RunInfo
from embodyhpc.tracking.mlflow_run import client, tracking_uri
from embodyhpc.validation import load_resolved
from tests.helpers import run_dir_from, statuses, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm"), pytest.mark.slow]
RECIPE = "recipes/demo_metaworld_cpu.yaml"


def _finished(cli, run, kinds=("train", "report")) -> dict:
    jobs = statuses(cli, run)
    return jobs if all(jobs[k]["state"] not in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "UNKNOWN")
                       for k in kinds if k in jobs) else {}


def test_cancelled_2_node_run_resumes_on_1_node_then_trains_on(cli, slurm_cluster, runs_root, reach_demos):
    result = cli("submit", RECIPE, "--site", "local", "--json", f"job.runs_root={runs_root}",
                 f"data.root={reach_demos}", "resources.mem=1G", "train.steps=100000", "train.log_every=1",
                 "train.warmup_steps=2", "checkpoint.every_steps=5", "checkpoint.keep_latest_k=2",
                 "eval.enabled=false", "tracking.telemetry_interval_s=0")
    assert result.code == 0, result.err
    run = run_dir_from(result.out)
    first_train = RunInfo.load(run).jobs["train"].job_id
    wait_for(lambda: (layout.list_steps(run / "checkpoints").newest_complete or 0) >= 10, 300, "checkpoint 10")

    refused = cli("resume", str(run), "--nodes", "1")  # still running: refused, naming the job
    assert refused.code == 2 and f"train job {first_train} is RUNNING" in refused.err, refused.err

    assert cli("cancel", str(run)).code == 0
    wait_for(lambda: _finished(cli, run), 120, "the cancelled jobs to end")
    stopped_at = layout.list_steps(run / "checkpoints").newest_complete
    assert stopped_at >= 10  # a run cancelled long before its end, on any machine: it was to train 100000 steps
    first_end, second_end = stopped_at + 20, stopped_at + 26

    result = cli("resume", str(run), "--nodes", "1", f"train.steps={first_end}", "--json")
    assert result.code == 0, result.err
    # the same MLflow run goes on; what a killed attempt logged past its last checkpoint left the store
    assert f"MLflow run {RunInfo.load(run).mlflow_run_id} goes on (was " in result.err, result.err
    second = RunInfo.load(run)
    assert second.attempt == 2 and second.resumed_from_step == stopped_at and second.backend == "slurm"
    assert "#SBATCH --nodes=1" in (run / "scripts" / "train.sbatch").read_text()
    jobs = wait_for(lambda: _finished(cli, run), 400, "attempt 2")
    assert jobs["train"]["state"] == "COMPLETED", jobs
    done = json.loads((run / "logs" / "train_result.json").read_text())
    assert (done["world_size"], done["resumed_from_step"], done["steps"]) == (1, stopped_at, first_end)

    assert f"already trained to train.steps={first_end}" in cli("resume", str(run)).err
    result = cli("resume", str(run), f"train.steps={second_end}", "--exclude", "n2", "--json")
    assert result.code == 0, result.err
    assert "#SBATCH --exclude=n2" in (run / "scripts" / "train.sbatch").read_text()
    jobs = wait_for(lambda: _finished(cli, run), 400, "attempt 3")
    assert jobs["train"]["state"] == "COMPLETED" and jobs["train"]["nodes"] == "n1", jobs  # kept off n2
    done = json.loads((run / "logs" / "train_result.json").read_text())
    assert (done["world_size"], done["resumed_from_step"], done["steps"]) == (1, first_end, second_end)  # nodes stay

    steps = [json.loads(line)["step"] for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, second_end + 1)), "every step once in metrics.jsonl"
    config = load_resolved(run)
    history = client(tracking_uri(config.tracking, config.job.runs_root)).get_metric_history(
        RunInfo.load(run).mlflow_run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, second_end + 1)), "one MLflow curve: none twice or missing"
    status = json.loads(cli("status", str(run), "--json").out)
    assert [a["number"] for a in status["attempts"]] == [1, 2, 3]
    assert status["attempts"][0]["jobs"][0]["state"].startswith("CANCELLED")
    assert [a["jobs"][0]["state"] for a in status["attempts"][1:]] == ["COMPLETED", "COMPLETED"]
    text = cli("status", str(run)).out
    assert "attempt 2 (resume from step" in text and "resources.nodes=1" in text and f"train.steps={second_end}" in text
    logs = cli("logs", str(run), "--job", "train").out
    assert "attempt 1 train task 1" in logs and "attempt 2 train task 0" in logs and "attempt 3 train task 0" in logs
    assert "attempt 2 train task 1" not in logs  # attempt 2 ran one rank on one node
