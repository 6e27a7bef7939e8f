"""The report job: runs after training and the evaluation array, whatever their outcome.

It never averages silently over fewer episodes than planned: missing shards and a failed
training run are recorded as such.
"""

from __future__ import annotations

import json
from pathlib import Path

from embodyhpc.config.load import load_resolved
from embodyhpc.eval.shards import plan_shards
from embodyhpc.launch.eval import shard_file
from embodyhpc.launch.train import RESULT_FILE
from embodyhpc.rundir import RunInfo, write_json_atomic

REPORT_FILE = "eval/report.json"


def report_task(run_dir: str) -> dict:
    from embodyhpc.slurm.status import chain_status  # job states come from Slurm (or run.json)

    run = Path(run_dir)
    config = load_resolved(run)
    ev = config.eval
    plan = plan_shards(list(ev.tasks), list(ev.seeds), ev.episodes_per_task, ev.shards)
    states = {s.kind: s for s in chain_status(RunInfo.load(run)) if s.kind != "report"}
    train = states.get("train")
    trained = (run / RESULT_FILE).is_file()

    found, missing, episodes = [], [], 0
    for shard, planned in enumerate(plan):
        path = shard_file(run, shard)
        if not path.is_file():
            missing.append(shard)
            continue
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if len(records) != len(planned):
            missing.append(shard)
            continue
        found.append(shard)
        episodes += len(records)

    if not trained:
        why = f"training did not finish (state {train.state if train else 'unknown'}"
        why += f", exit {train.exit_code})" if train and train.exit_code is not None else ")"
        outcome = "train_failed"
    elif missing:
        why, outcome = f"{len(missing)} of {len(plan)} evaluation shards missing: {missing}", "incomplete"
    else:
        why, outcome = "all shards reported", "complete"
    report = {
        "outcome": outcome,
        "why": why,
        "train": {"finished": trained, "state": train.state if train else None,
                  "exit_code": train.exit_code if train else None},
        "eval": {"shards_planned": len(plan), "shards_found": found, "shards_missing": missing,
                 "episodes_planned": sum(len(p) for p in plan), "episodes_recorded": episodes,
                 "state": states["eval"].state if "eval" in states else None},
    }
    write_json_atomic(run / REPORT_FILE, report)
    print(f"report: {outcome}: {why}", flush=True)
    return report
