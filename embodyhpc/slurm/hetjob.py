"""A heterogeneous Slurm job (the RL job: actor, rollout and env groups): submitted, read back and summarised here.

submitit cannot submit a heterogeneous job, so the plan's script (rl.sbatch.j2, rendered once by the plan) goes to
`sbatch --parsable` as it is, with the dependency options every job of a chain gets; run.json records the job id J.
Slurm names the groups' components J+0, J+1, J+2 (sacct and squeue list one row each); `scancel J` and
`scontrol requeue J` act on all of them (commands.cancel, commands.requeue). status.py reads the components' rows and
summarises them with `summarise_states` into the one state `embodyhpc status` and `runs` show for the job.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from embodyhpc.rundir import script_file, submitit_folder, write_private
from embodyhpc.runinfo import JobRecord, RunInfo
from embodyhpc.slurm import commands

# a component in one of these has ended without success: the whole job has (its srun step spans every group, so
# the others are being torn down); the worst one names the job's state
FAILED_STATES = ("BOOT_FAIL", "CANCELLED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                 "TIMEOUT")
_WORST_FIRST = ("NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY", "FAILED", "DEADLINE", "TIMEOUT", "PREEMPTED",
                "CANCELLED")
_ACTIVE_ORDER = ("COMPLETING", "RUNNING", "CONFIGURING", "RESIZING", "SUSPENDED", "REQUEUED", "PENDING")


class HetJob(Protocol):
    """What `submit` reads of a plan's job (embodyhpc.orchestrate.plan.Job)."""

    kind: str
    script: str
    script_path: Path


def submit(job: HetJob, run_dir: Path, info: RunInfo, sbatch_args: list[str]) -> JobRecord:
    """sbatch the job's script (written to scripts/ first: it is what sbatch reads) with `sbatch_args` (its
    dependencies); the record goes to run.json at once."""
    from embodyhpc.slurm.executor import without_job_environment  # submitted from inside a job: not its variables

    submitit_folder(run_dir).mkdir(parents=True, exist_ok=True)  # the groups' logs go there, as other jobs' do
    write_private(job.script_path, job.script)
    job_id = commands.sbatch_parsable(str(job.script_path), sbatch_args, without_job_environment(os.environ))
    dependency = next((arg.split("=", 1)[1] for arg in sbatch_args if arg.startswith("--dependency=")), None)
    record = JobRecord(kind=job.kind, job_id=job_id, dependency=dependency)
    info.jobs[job.kind] = record
    info.save()
    return record


def is_component(job_id: str) -> bool:
    """sacct/squeue name a heterogeneous job's components J+0, J+1, ..."""
    return "+" in job_id


def component_offset(job_id: str) -> int:
    """J+2 -> 2 (the group's index: 0 actor, 1 rollout, 2 env for the RL job)."""
    return int(job_id.split(".")[0].split("+", 1)[1])


def component_count(run_dir: Path | str, kind: str) -> int | None:
    """How many components the job has: the groups of the script sbatch received (scripts/<kind>.sbatch, written by
    `submit`), None when it cannot be read. sacct reports a finished job's components one by one, seconds apart:
    the job is not done before all of them are."""
    try:
        text = script_file(Path(run_dir), kind).read_text()
    except OSError:
        return None
    return 1 + sum(line.strip() == "#SBATCH hetjob" for line in text.splitlines())


def summarise_states(states: Iterable[str]) -> str:
    """One state for the job from its components' states: FAILED (or the worst failure) as soon as any component
    failed; RUNNING while any runs; COMPLETED only when every component did; else the queue state (PENDING,
    REQUEUED)."""
    states = list(states)
    if not states:
        return "UNKNOWN"
    failed = [state for state in states if state in FAILED_STATES]
    if failed:
        return min(failed, key=_WORST_FIRST.index)
    if all(state == "COMPLETED" for state in states):
        return "COMPLETED"
    active = [state for state in states if state in _ACTIVE_ORDER]
    if active:
        return min(active, key=_ACTIVE_ORDER.index)
    return next(state for state in states if state != "COMPLETED")  # a state Slurm added later: shown as it is
