"""Execute a plan on Slurm through submitit: one sbatch per job, dependencies as job ids. A heterogeneous job (a
shape with groups: the RL job) goes to sbatch through embodyhpc.slurm.hetjob instead, which submitit cannot do.

An `afterok` job is submitted with --kill-on-invalid-dep=yes, so a failed training job cancels the evaluation
array instead of leaving it pending forever; the report (`afterany`) still runs and records why. If one submission
fails, the jobs already submitted are cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from embodyhpc.plugins import import_name
from embodyhpc.rundir import submitit_folder, write_private
from embodyhpc.runinfo import JobRecord, RunInfo
from embodyhpc.slurm import commands, hetjob
from embodyhpc.slurm.executor import RecipeExecutor

if TYPE_CHECKING:
    from embodyhpc.orchestrate.plan import Job, JobSpec, Plan

Progress = Callable[[str], None]


def dependency_args(job: JobSpec, job_ids: dict[str, str]) -> list[str]:
    """The sbatch options that make `job` wait for the jobs it depends on (by their ids)."""
    if not job.after:
        return []
    args = [f"--dependency={job.condition}:{':'.join(job_ids[kind] for kind in job.after)}"]
    return args + (["--kill-on-invalid-dep=yes"] if job.condition == "afterok" else [])


class SlurmBackend:
    """Slurm as a backend (orchestrate.api.Backend): sbatch through submitit, sacct, scancel."""

    cancel_note = None

    def submit(self, plan: Plan, info: RunInfo, progress: Progress = print) -> RunInfo:
        """Submit every job of `plan` in order; each job's record goes to run.json as soon as it is submitted."""
        job_ids: dict[str, str] = {}
        try:
            for job in plan.jobs:
                record = self._submit_job(job, plan, info, job_ids)
                progress(f"submitted {record.kind}: job {record.job_id}"
                         + (f" ({record.dependency})" if record.dependency else ""))
        except BaseException:
            if job_ids:
                commands.cancel(list(job_ids.values()))
            raise
        return info

    def _submit_job(self, job: Job, plan: Plan, info: RunInfo, job_ids: dict[str, str]) -> JobRecord:
        sbatch_args = dependency_args(job.spec, job_ids)
        if job.shape.groups:
            record = hetjob.submit(job, plan.run_dir, info, sbatch_args)
            job_ids[job.kind] = str(record.job_id)
            return record
        executor = RecipeExecutor(submitit_folder(plan.run_dir), shape=job.shape, script=job.script,
                                  python=plan.python, sbatch_args=sbatch_args,
                                  max_num_timeout=job.shape.max_requeues)
        task = import_name(job.spec.task)
        size = job.shape.array_size
        if size:
            handle = executor.map_array(task, [str(plan.run_dir)] * size, range(size))[0]
        else:
            handle = executor.submit(task, str(plan.run_dir))
        job_ids[job.kind] = str(handle.job_id).split("_")[0]
        write_private(job.script_path, job.script)  # what sbatch received (the executor checked it is)
        record = JobRecord(kind=job.kind, job_id=job_ids[job.kind], array_size=size,
                           dependency=sbatch_args[0].split("=", 1)[1] if sbatch_args else None)
        info.jobs[job.kind] = record
        info.save()
        return record

    def poll(self, info: RunInfo) -> dict[str, str]:
        """Each job's state as Slurm reports it (sacct and squeue; run.json's when sacct does not answer)."""
        from embodyhpc.slurm.status import chain_status

        return {status.kind: status.state for status in chain_status(info)}

    def cancel(self, info: RunInfo) -> list[str]:
        """scancel every job the run recorded; the ids cancelled."""
        ids = [r.job_id for r in info.jobs.values() if r.job_id]
        commands.cancel(ids)
        return ids
