"""The RL job's entry point: every process of the job runs `rl_task(run_dir)` (or `python -m embodyhpc.launch.rl
RUN_DIR`, what the heterogeneous sbatch script's srun line runs) and plays the role the environment gives it
(embodyhpc.rl.roles): actor, rollout or env (embodyhpc.rl.pipeline).

Preemption and time limits, as for training (the decision is launch/requeue.py's, shared with launch/train.py):
SIGUSR2 and SIGTERM only set a flag (train/preempt.StopSignal); the actor ranks agree on it at the next optimizer
step, save that version (blocking: the model, the optimizer, the RNG states, the version counter as the checkpoint's
step), send their last weights marked last, which makes every rollout worker tell its env workers to stop, so every
role ends. Then actor rank 0 requeues the whole job (SIGUSR2, fewer than resources.max_requeues restarts; under
Slurm with scontrol: the script exports SUBMITIT_EXECUTOR=slurm) and the actor ranks exit with Requeued; the next
start, or `resume`, continues from the saved version with the same counter, and the metrics file keeps its lines up
to it. Actor rank 0 writes logs/train_result.json (the result file `status` and the report read) and the MLflow
metrics.
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
        sinks = [JsonlMetricsSink(run / METRICS_FILE, resume_step=resume_version(run)), ConsoleMetricsSink()]
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


def resume_version(run: Path) -> int:
    """The version this start continues from: the newest complete checkpoint's step (what the actor loads), 0 for
    a fresh run. The metrics file keeps its lines up to it: a requeued or resumed run's curve goes on from there
    (versions logged after it, by an attempt that died before saving them, are trained again and logged anew)."""
    from embodyhpc.checkpoint.layout import list_steps
    from embodyhpc.rundir import CHECKPOINTS_DIR

    return list_steps(run / CHECKPOINTS_DIR).newest_complete or 0


def _after_stop(result: dict[str, Any], config: Any, run: Path) -> None:
    """Actor rank 0 after a stop signal: requeue the whole job (as training does), or fail saying why."""
    from embodyhpc.launch.requeue import decide_and_requeue, end_stopped_attempt

    result["stopped_at_step"] = result["version"]
    decision = decide_and_requeue(result, config.resources.max_requeues, run, session_id().split(".")[0], label="rl")
    end_stopped_attempt(decision, result, run, write_result=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m embodyhpc.launch.rl RUN_DIR", file=sys.stderr)
        raise SystemExit(2)
    rl_task(sys.argv[1])
