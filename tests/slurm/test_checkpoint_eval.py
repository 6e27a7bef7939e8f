"""Evaluations of checkpoints while training runs, on the real 2-node cluster: the training job itself submits an
export -> eval array -> report chain for every k-th checkpoint, and those jobs run while training goes on."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from embodyhpc.rundir import requested_evals
from embodyhpc.runinfo import RunInfo
from embodyhpc.slurm import commands
from tests.helpers import run_dir_from, statuses, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm")]  # one worker: the cluster has 2 nodes
RECIPE = "recipes/demo_metaworld_cpu.yaml"


def _times(job_id: str) -> tuple[datetime, datetime, datetime]:
    """(Submit, Start, End) of a job (an array: its earliest submit and start, latest end) as sacct records them."""
    out = commands.run(["sacct", "--noheader", "--parsable2", "--allocations", f"--jobs={job_id}",
                        "--format=Submit,Start,End"])
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
    column = [[datetime.fromisoformat(v) for v in values if v[:1].isdigit()] for values in zip(*rows, strict=True)]
    return min(column[0]), min(column[1]), max(column[2])


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
    # beside training, never blocking it: the training job itself submitted the first evaluation's export while it
    # ran, with no dependency on its own end (whether the export also finished first is a race of speeds, not asked)
    _, train_start, train_end = _times(train_id)
    export = RunInfo.load(evals[0]).jobs["export"]
    export_submit, _, _ = _times(export.job_id)
    assert train_start <= export_submit <= train_end, (train_start, export_submit, train_end)
    assert not export.dependency, export.dependency
    assert json.loads((run / "logs" / "train_result.json").read_text())["steps"] == 60
    wait_for(lambda: len((run / "eval" / "history.jsonl").read_text().splitlines()) == 3, 60, "3 history lines")
    history = [json.loads(line) for line in (run / "eval" / "history.jsonl").read_text().splitlines()]
    assert sorted(h["step"] for h in history) == [20, 40, 60]
    text = cli("status", str(run)).out
    assert "evaluations while training:" in text and "step-40: export COMPLETED" in text
