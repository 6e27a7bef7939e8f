"""After a stop signal, for every job that saves and requeues itself: training (launch/train.py) and the RL job
(launch/rl.py). SIGUSR2 (the time-limit warning, or a preemption Slurm announces) or SIGTERM (Slurm ends the job)
was received and the job's state is saved; then

    decision = decide_and_requeue(result, max_requeues, run_dir, job_id)   # rank 0 only: requeue once if allowed
    end_stopped_attempt(decision, result, run_dir, write_result=rank == 0) # every rank: leave the same way

- SIGUSR2, fewer than `max_requeues` restarts so far: requeued (`scontrol requeue <job>` under Slurm) and every
  rank exits with preempt.Requeued (no result file: the next attempt writes it);
- SIGUSR2 with the limit reached, or a failed requeue: the job fails with TrainingStopped, and the result file
  says why and where the checkpoint is;
- SIGTERM: Slurm cancels or requeues the job itself; every rank exits with preempt.Stopped.
Every stopped attempt appends one line to logs/train_attempts.jsonl (rank 0). "Under Slurm" is
SUBMITIT_EXECUTOR=slurm: submitit's jobs have it, and the RL job's script (rl.sbatch.j2) exports it; Slurm then
counts the restarts (SLURM_RESTART_COUNT), the local backend counts the requeues recorded in that file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from embodyhpc.atomic import write_json_atomic
from embodyhpc.rundir import ATTEMPTS_FILE, CHECKPOINTS_DIR, RESULT_FILE


class TrainingStopped(RuntimeError):
    """The job stopped for a time limit or preemption and was not requeued (the message says why and what to do)."""


def restart_count(run_dir: Path, job_id: str) -> int:
    """How often this job was restarted so far: Slurm counts every requeue (ours, an admin's, a node failure's);
    submitit's local executor counts nothing, so there it is the requeues this job recorded in ATTEMPTS_FILE."""
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        return int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    path = run_dir / ATTEMPTS_FILE
    if not path.is_file():
        return 0
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(1 for r in records if r.get("job_id") == job_id and r.get("outcome") == "requeued")


def decide_and_requeue(result: dict, max_requeues: int, run_dir: Path, job_id: str, *,
                       label: str = "train") -> dict[str, Any]:
    """Rank 0 only (no collectives): requeue once if allowed, and record the attempt. `result` holds stopped_by
    (the signal's name) and stopped_at_step; `label` starts the line printed to the job's log."""
    signal_name, step = result["stopped_by"], result["stopped_at_step"]
    restarts = restart_count(run_dir, job_id)
    on_slurm = os.environ.get("SUBMITIT_EXECUTOR") == "slurm"
    saved = f"stopped by {signal_name} at step {step} (checkpoint saved)"
    if signal_name != "SIGUSR2":
        outcome, message = "stopped", f"{saved}; Slurm is ending the job, embodyhpc does not requeue it"
    elif restarts >= max_requeues:
        outcome = "failed"
        message = (f"{saved} and not requeued: the job was already restarted {restarts} time(s) and "
                   f"resources.max_requeues={max_requeues} (raise it, or resources.time so that fewer restarts are "
                   f"needed); the checkpoint of step {step} stays under {run_dir / CHECKPOINTS_DIR}")
    else:
        outcome, message = "requeued", f"{saved}; requeued (restart {restarts + 1} of at most {max_requeues})"
        if on_slurm:
            from embodyhpc.errors import SlurmError
            from embodyhpc.slurm import commands

            try:
                commands.requeue(job_id)
            except SlurmError as exc:
                outcome, message = "failed", f"{saved} but the requeue failed: {exc}"
    print(f"{label}: {message}", flush=True)
    record = {"job_id": job_id, "restart_count": restarts, "outcome": outcome, "signal": signal_name,
              "step": step, "resumed_from_step": result.get("resumed_from_step"), "message": message}
    try:
        path = run_dir / ATTEMPTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as exc:  # the record is for people and the local restart count; the decision stands
        print(f"{label}: could not record the attempt in {ATTEMPTS_FILE}: {exc}", flush=True)
    return {"outcome": outcome, "message": message}


def end_stopped_attempt(decision: dict[str, Any], result: dict, run_dir: Path, *, write_result: bool) -> None:
    """Every rank, after its process group is gone: leave as requeued, or as stopped by Slurm, or fail saying why
    (the rank that `write_result`s records the failure in the result file first)."""
    from embodyhpc.train.preempt import Requeued, Stopped

    if decision["outcome"] == "requeued":
        raise Requeued(decision["message"])
    if decision["outcome"] == "stopped":  # SIGTERM: Slurm cancels or requeues the job itself; no result of ours
        raise Stopped(decision["message"])
    result.update(status="failed", error=decision["message"])
    if write_result:
        write_json_atomic(run_dir / RESULT_FILE, result)
    raise TrainingStopped(decision["message"])
