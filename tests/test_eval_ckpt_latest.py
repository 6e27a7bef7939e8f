"""`latest` is your newest training run: an `eval --ckpt` folder made after it (a chain of export, eval and report,
no training) does not take its place; with only evaluations under the runs root, the newest of them."""

from __future__ import annotations

import sys

from embodyhpc.rundir import make_run_dir
from embodyhpc.runinfo import JobRecord, RunInfo
from embodyhpc.runstate import LATEST
from embodyhpc.submit import find_run


def run_folder(root, name: str, *jobs: str, parent_run: str | None = None):
    run = root / "demo" / name
    assert make_run_dir(run)
    RunInfo(run_id=name, run_dir=str(run), backend="local", recipe="r.yaml", site=None, overrides=[],
            python=sys.executable, created="2026-01-01T00:00:00+0000", parent_run=parent_run,
            jobs={kind: JobRecord(kind, job_id=str(100 + i)) for i, kind in enumerate(jobs)}).save()
    return run


def test_latest_is_the_newest_training_run_not_an_evaluation_after_it(tmp_path):
    only_eval = run_folder(tmp_path, "demo-20260101-090000", "export", "eval", "report")
    assert RunInfo.load(only_eval).kind == "eval"
    assert find_run(LATEST, tmp_path) == only_eval  # nothing else of yours: the evaluation
    training = run_folder(tmp_path, "demo-20260101-100000", "train", "eval", "report")
    adhoc = run_folder(tmp_path, "demo-20260101-110000", "eval", "report")  # eval --ckpt of an export, newer
    assert (RunInfo.load(training).kind, RunInfo.load(adhoc).kind) == ("train", "eval")
    assert find_run(LATEST, tmp_path) == training
    assert find_run(adhoc.name, tmp_path) == adhoc  # asked for by name: the evaluation
    fresh = run_folder(tmp_path, "demo-20260101-120000")  # submitted, its jobs not recorded yet: training
    assert find_run(LATEST, tmp_path) == fresh
    assert RunInfo.load(run_folder(tmp_path, "x", "eval", "report", parent_run=str(training))).kind == \
        "checkpoint_eval"
