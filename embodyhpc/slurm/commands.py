"""The only place that runs Slurm's command-line tools (sbatch is run by submitit, from here too).

Arguments are always lists: no shell, nothing from a recipe is ever parsed by a shell here.
"""

from __future__ import annotations

import shutil
import subprocess

from embodyhpc.errors import SlurmError

TIMEOUT_S = 60


def run(args: list[str], *, timeout_s: float = TIMEOUT_S, check: bool = True) -> str:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError as exc:
        raise SlurmError(f"{args[0]} not found: is Slurm installed and on PATH?") from exc
    except subprocess.TimeoutExpired as exc:
        raise SlurmError(f"{' '.join(args)} did not answer within {timeout_s:.0f} s") from exc
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
    if job_ids:
        run(["scancel", *job_ids])
