"""Evaluations of checkpoints while training runs, on the real 2-node cluster: the training job itself submits an
export -> eval array -> report chain for every k-th checkpoint, and those jobs run while training goes on."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from embodyhpc.rundir import RunInfo, requested_evals
from embodyhpc.slurm import commands
from tests.helpers import run_dir_from, statuses, wait_for

pytestmark = pytest.mark.slurm
RECIPE = "recipes/demo_metaworld_cpu.yaml"


def _times(job_id: str) -> tuple[datetime, datetime]:
    """(Start, End) of a job (an array: its earliest start, latest end) as sacct records them."""
    out = commands.run(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={job_id}",
                        "--format=Start,End"])
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 1]
    starts = [datetime.fromisoformat(s) for s, _ in rows if s[:1].isdigit()]
    ends = [datetime.fromisoformat(e) for _, e in rows if e[:1].isdigit()]
    return min(starts), max(ends)


def test_training_job_submits_checkpoint_evaluations_that_run_beside_it(cli, slurm_cluster, runs_root, reach_demos):
    result = cli("submit", RECIPE, "--site", "local", "--json", f"job.runs_root={runs_root}",
                 f"data.root={reach_demos}", "resources.mem=1G", "eval.mem=1G", "train.steps=60", "train.log_every=10",
                 "train.warmup_steps=5", "checkpoint.every_steps=10", "checkpoint.keep_latest_k=2",
                 "eval.every_k_checkpoints=2", "eval.tasks=[reach-v3]", "eval.episodes_per_task=2", "eval.shards=2",
                 "eval.max_steps=30", "eval.videos_per_task=0", "eval.reference_policies=[random]")
    assert result.code == 0, result.err
    run = run_dir_from(result.out)
    train_id = json.loads((run / "run.json").read_text())["jobs"]["train"]["job_id"]
    wait_for((run / "eval" / "report.json").is_file, 420, "the training run's report")
    evals = requested_evals(run)
    assert [p.name for p in evals] == ["step-20", "step-40"]
    for path in evals:
        wait_for((path / "eval" / "report.json").is_file, 240, f"{path.name}'s report")
        report = json.loads((path / "eval" / "report.json").read_text())
        assert report["outcome"] == "complete" and report["checkpoint_step"] == int(path.name.split("-")[1])
        info = RunInfo.load(path)
        assert info.backend == "slurm" and info.parent_run == str(run) and set(info.jobs) == {"export", "eval",
                                                                                               "report"}
        # submitted by the training job: shards on the cluster's nodes, sacct's view of the three jobs
        jobs = wait_for(lambda p=path: (s := statuses(cli, p)) and all(j["state"] == "COMPLETED"
                                                                       for j in s.values()) and s,
                        60, f"{path.name}'s jobs COMPLETED in sacct")
        assert jobs["eval"]["array_counts"] == {"COMPLETED": 2}
        hosts = {json.loads(line)["host"] for f in (path / "eval" / "shards").glob("*/shard-*.jsonl")
                 for line in f.read_text().splitlines()}
        assert hosts and hosts <= {"n1", "n2"}
    # never blocking training: the first evaluation's export job ran (and ended) while training still ran
    _, train_end = _times(train_id)
    export_start, export_end = _times(RunInfo.load(evals[0]).jobs["export"].job_id)
    assert export_end <= train_end, (export_start, export_end, train_end)
    assert json.loads((run / "logs" / "train_result.json").read_text())["steps"] == 60
    wait_for(lambda: len((run / "eval" / "history.jsonl").read_text().splitlines()) == 3, 60, "3 history lines")
    history = [json.loads(line) for line in (run / "eval" / "history.jsonl").read_text().splitlines()]
    assert sorted(h["step"] for h in history) == [20, 40, 60]
    text = cli("status", str(run)).out
    assert "evaluations while training:" in text and "step-40: export COMPLETED" in text
