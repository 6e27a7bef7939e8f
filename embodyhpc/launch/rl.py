"""The RL job's entry point: every process of the job runs `rl_task(run_dir)` (or `python -m embodyhpc.launch.rl
RUN_DIR`, what the heterogeneous sbatch script's srun line runs) and plays the role the environment gives it
(embodyhpc.rl.roles): actor, rollout or env (embodyhpc.rl.pipeline).

Preemption and time limits, as for training (launch/train.py): SIGUSR2 and SIGTERM only set a flag
(train/preempt.StopSignal); the actor ranks agree on it at the next optimizer step, save that version (blocking: the
model, the optimizer, the RNG states, the version counter as the checkpoint's step), send their last weights marked
last, which makes every rollout worker tell its env workers to stop, so every role ends. Then actor rank 0 requeues
the job (SIGUSR2, fewer than resources.max_requeues restarts) and the actor ranks exit with Requeued; `resume`
continues from the saved version with the same counter. Actor rank 0 writes logs/train_result.json (the result
file `status` and the report read) and the MLflow metrics.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from embodyhpc.atomic import write_json_atomic
from embodyhpc.rundir import METRICS_FILE, RESULT_FILE


def session_id() -> str:
    """What every process of one start of the job shares, and a requeue or resume does not."""
    try:
        import submitit

        job = str(submitit.JobEnvironment().job_id)
    except Exception:  # noqa: BLE001 - started by srun without submitit (the het job's script)
        job = os.environ.get("SLURM_JOB_ID", "local")
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    if os.environ.get("SUBMITIT_EXECUTOR") == "local":
        restart = f"{restart}.{os.getppid()}"  # every task of one local start has the same parent
    return f"{job}.{restart}"


def rl_task(run_dir: str) -> dict[str, Any]:
    from embodyhpc.rl.pipeline import run_role
    from embodyhpc.rl.roles import role_from_environment
    from embodyhpc.train.preempt import StopSignal
    from embodyhpc.validation import load_resolved

    run = Path(run_dir)
    config = load_resolved(run_dir)
    role = role_from_environment()
    stop = StopSignal().install()
    os.environ.setdefault("MUJOCO_GL", "egl")
    is_lead = role.role == "actor" and role.role_rank == 0
    sinks: list = []
    tracking = None
    if is_lead:
        from embodyhpc.launch import observe
        from embodyhpc.train.metrics import ConsoleMetricsSink, JsonlMetricsSink

        tracking = observe.RunTracking(config, run, rank=0, local_rank=0)
        sinks = [JsonlMetricsSink(run / METRICS_FILE), ConsoleMetricsSink()]
    try:
        if tracking is not None:
            with tracking.attempt():
                result = run_role(config, run, role, session=session_id(), stop=stop,
                                  sinks=[*sinks, *tracking.sinks()])
        else:
            result = run_role(config, run, role, session=session_id(), stop=stop, sinks=sinks)
    except Exception as exc:
        if is_lead:
            from embodyhpc.data.guard import one_line

            write_json_atomic(run / RESULT_FILE, {"status": "failed", "error": one_line(exc), "mode": "rl"})
        raise
    finally:
        for sink in sinks:
            sink.close()
    if is_lead:
        result.update(status="completed", mode="rl", steps=result["version"],
                      resumed_from_step=result["start_version"])
        if result.get("stopped_by"):
            _after_stop(result, config, run)
        write_json_atomic(run / RESULT_FILE, result)
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # done: a late time-limit warning means nothing now
    return result


def _after_stop(result: dict[str, Any], config: Any, run: Path) -> None:
    """Actor rank 0 after a stop signal: requeue (as training does) or fail saying why."""
    from embodyhpc.launch.train import TrainingStopped, _decide_and_requeue
    from embodyhpc.train.preempt import Requeued, Stopped

    result["stopped_at_step"] = result["version"]
    decision = _decide_and_requeue(result, config.resources.max_requeues, run, session_id().split(".")[0])
    if decision["outcome"] == "requeued":
        raise Requeued(decision["message"])
    if decision["outcome"] == "stopped":
        raise Stopped(decision["message"])
    result.update(status="failed", error=decision["message"])
    write_json_atomic(run / RESULT_FILE, result)
    raise TrainingStopped(decision["message"])


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m embodyhpc.launch.rl RUN_DIR", file=sys.stderr)
        raise SystemExit(2)
    rl_task(sys.argv[1])
