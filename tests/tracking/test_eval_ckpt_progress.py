"""`embodyhpc eval --ckpt` run here: episodes done of those planned while the shards run (counted from the shard
files the array writes), then the success table in 80 columns with real task names."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from types import SimpleNamespace

from cli import eval_view
from embodyhpc.rundir import shard_file
from embodyhpc.runinfo import RunInfo


def stats(successes: int, recorded: int, planned: int, low: float, high: float) -> dict:
    rate = successes / recorded if recorded else None
    return {"successes": successes, "recorded": recorded, "planned": planned, "success_rate": rate, "ci_low": low,
            "ci_high": high}


# Wilson 95% of 4/5: [0.376, 0.964]; 5/5: [0.566, 1.0]; 9/10: [0.596, 0.982]; 0/5: [0.0, 0.434]
RESULTS = {"policies": {
    "random": {"overall": stats(0, 10, 10, 0.0, 0.278),
               "tasks": {"button-press-topdown-wall-v3": stats(0, 5, 5, 0.0, 0.434),
                         "reach-v3": stats(0, 5, 5, 0.0, 0.434)}},
    "trained": {"overall": stats(9, 10, 10, 0.596, 0.982),
                "tasks": {"button-press-topdown-wall-v3": stats(4, 5, 5, 0.376, 0.964),
                          "reach-v3": stats(5, 5, 5, 0.566, 1.0)}},
    "expert": {"overall": stats(9, 9, 10, 0.701, 1.0),
               "tasks": {"button-press-topdown-wall-v3": stats(4, 4, 5, 0.510, 1.0),
                         "reach-v3": stats(5, 5, 5, 0.566, 1.0)}}}}


def test_the_success_table_fits_80_columns_with_every_number():
    lines = eval_view.success_table(RESULTS, width=80).splitlines()
    assert max(map(len, lines)) <= 80, lines
    assert lines[0].split() == ["task", "trained", "expert", "random"]  # trained first, then the references
    text = "\n".join(lines)
    for cell in ("0.80 [0.38, 0.96] 4/5", "1.00 [0.57, 1.00] 5/5", "0.90 [0.60, 0.98] 9/10",  # trained: intervals
                 "1.00 4/4 (1 missing)", "0.00 0/5", "0.00 0/10", "1.00 9/9 (1 missing)"):
        assert cell in text, (cell, text)
    assert lines[-1].startswith("all tasks")
    assert any(line.startswith("button-press-") for line in lines)  # a long name is cut (ellipsis) to fit


def test_progress_counts_the_episodes_the_shards_recorded(tmp_path, monkeypatch):
    run = tmp_path / "eval-1"
    run.mkdir()
    RunInfo(run_id=run.name, run_dir=str(run), backend="local", recipe="x", site=None, overrides=[], python="py",
            created="now", jobs={}).save()

    @contextmanager
    def suite(name, tasks, **options):  # the suite expands the recipe's task list (MetaWorld: MT10 -> 10 names)
        yield SimpleNamespace(tasks=["reach-v3", "push-v3", "door-open-v3"])

    monkeypatch.setattr("embodyhpc.eval.suites.make_suite", suite)
    config = SimpleNamespace(eval=SimpleNamespace(suite="metaworld", tasks=["MT3"], suite_options={}, seeds=[100, 101],
                                                  episodes_per_task=2, reference_policies=["random"]))
    assert eval_view.planned_episodes(config) == 3 * 2 * 2 * 2  # tasks x seeds x episodes x (trained + random)
    shown, seen = [], threading.Event()

    def show(text):
        shown.append(text)
        seen.set()

    def shard(policy, index, episodes):
        path = shard_file(run, policy, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"episode": e}) + "\n" for e in range(episodes)))

    with eval_view.EpisodeProgress(config, show, poll_s=0.01) as watch:
        # the event is cleared before each change: the watcher may show the line before this thread waits for it
        for step, (policy, index, episodes) in enumerate([(None, 0, 0), ("trained", 0, 6), ("random", 1, 6)]):
            seen.clear()
            if policy:
                shard(policy, index, episodes)
            else:
                watch.started(run)
            assert seen.wait(30), (step, shown)
    assert shown == ["eval: 0/24 episodes done", "eval: 6/24 episodes done", "eval: 12/24 episodes done"]


def test_no_progress_line_for_a_chain_submitted_to_slurm(tmp_path):
    run = tmp_path / "eval-2"
    run.mkdir()
    RunInfo(run_id=run.name, run_dir=str(run), backend="slurm", recipe="x", site=None, overrides=[], python="py",
            created="now", jobs={}).save()
    shown = []
    with eval_view.EpisodeProgress(SimpleNamespace(), shown.append, poll_s=0.01) as watch:
        watch.started(run)
        watch.thread.join(timeout=30)  # it stops by itself: `status` follows a Slurm chain
    assert shown == [] and not watch.thread.is_alive()
