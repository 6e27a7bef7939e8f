"""The only place that runs Slurm's command-line tools (sbatch is run by submitit, from here too).

Arguments are always lists: no shell, nothing from a recipe is ever parsed by a shell here.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator

from embodyhpc.errors import SlurmError, UserError
from embodyhpc.job_ids import JOB_ID

TIMEOUT_S = 60


def run(args: list[str], *, timeout_s: float = TIMEOUT_S, check: bool = True,
        immune_to: tuple[signal.Signals, ...] = ()) -> str:
    """Run a Slurm tool; `immune_to`: signals the tool ignores (see `_children_ignore`)."""
    try:
        with _children_ignore(immune_to):
            proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError as exc:
        raise SlurmError(f"{args[0]} not found: is Slurm installed and on PATH?") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{' '.join(args)} did not answer within {timeout_s:.0f} s") from exc
    except OSError as exc:  # not executable, argument list too long, ...
        raise SlurmError(f"{args[0]} could not be started: {exc.strerror or exc}") from exc
    if check and proc.returncode != 0:
        raise SlurmError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def reachable() -> tuple[bool, str]:
    """Whether a Slurm controller answers, and if not, why (for the --local fallback message)."""
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        return False, "sbatch/srun are not on PATH"
    try:
        run(["sinfo", "--noheader", "--format=%P"], timeout_s=15)
    except SlurmError as exc:
        return False, str(exc)
    return True, "ok"


def cancel(job_ids: list[str]) -> None:
    """scancel exactly these jobs. Anything but a job id (`--user=root`, `-1`, `1 2`, `1;rm`) is refused before
    scancel runs: as an argument it could widen what is cancelled."""
    bad = [job_id for job_id in job_ids if not (isinstance(job_id, str) and JOB_ID.fullmatch(job_id))]
    if bad:
        raise UserError(f"refusing to pass {bad[0]!r:.60} to scancel: not a Slurm job id", key="job_id",
                        fix="job ids are digits, or digits_digits for an array element; check the run's run.json")
    if job_ids:
        run(["scancel", *job_ids])


def sbatch_parsable(script: str, sbatch_args: list[str], prefix: list[str] | None = None) -> str:
    """`[prefix...] sbatch --parsable ARGS SCRIPT`: the job id Slurm gave (a job embodyhpc submits without
    submitit: the heterogeneous RL job). `prefix`: e.g. `env -u ...` (executor.without_job_environment)."""
    out = run([*(prefix or []), "sbatch", "--parsable", *sbatch_args, script])
    job_id = (out.strip().splitlines() or [""])[0].split(";")[0]  # "123" or "123;cluster"
    if not JOB_ID.fullmatch(job_id):
        raise SlurmError(f"sbatch --parsable answered {out.strip()[:100]!r}, not a job id")
    return job_id


def requeue(job_id: str) -> None:
    """Put a running job back into the queue (it restarts with the same id, SLURM_RESTART_COUNT + 1).

    Called by the training job's rank 0 after every rank saved at a preemption or time-limit signal. Slurm ends
    the running attempt itself (SIGCONT + SIGTERM to every process of the job, SIGKILL after KillWait) and starts
    the job again once its credential expires. scontrol runs inside the job, so it ignores both signals: slurmstepd
    delivers a signal to every process of the step one by one, and a scontrol started right after the time-limit
    SIGUSR2 reached rank 0 was killed by the same SIGUSR2 (seen on the local cluster: exit -12); the SIGTERM of
    the requeue itself could likewise kill it before it reports success.
    """
    run(["scontrol", "requeue", job_id], immune_to=(signal.SIGUSR2, signal.SIGTERM))


@contextlib.contextmanager
def _children_ignore(signals: tuple[signal.Signals, ...]) -> Iterator[None]:
    """Processes started inside the block ignore `signals`: an ignored disposition survives exec, so the parent's
    is set to SIG_IGN while the child starts and then put back. The parent misses those signals meanwhile, so use
    it only where they no longer matter (the requeue: the job has already stopped). Main thread only (Python sets
    handlers there); elsewhere the child gets no protection."""
    if not signals or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
