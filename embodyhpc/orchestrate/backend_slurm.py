"""Execute a plan on Slurm through submitit: one sbatch per job, dependencies as job ids.

An `afterok` job is submitted with --kill-on-invalid-dep=yes, so a failed training job cancels the evaluation
array instead of leaving it pending forever; the report (`afterany`) still runs and records why. If one submission
fails, the jobs already submitted are cancelled.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.orchestrate.plan import JobSpec, resolve_task
from embodyhpc.rundir import JobRecord, RunInfo, script_file, submitit_folder, write_private
from embodyhpc.slurm import commands
from embodyhpc.slurm.executor import RecipeExecutor
from embodyhpc.slurm.render import job_shape, render_job


def _executor(loaded: LoadedRecipe, kind: str, run_dir: Path, python: str,
              sbatch_args: list[str]) -> RecipeExecutor:
    def script(command: str) -> str:
        return render_job(loaded, kind, run_dir, python, command=command)

    return RecipeExecutor(submitit_folder(run_dir), shape=job_shape(loaded, kind), script=script,
                          python=python, sbatch_args=sbatch_args,
                          max_num_timeout=loaded.config.resources.max_requeues)


def dependency_args(job: JobSpec, job_ids: dict[str, str]) -> list[str]:
    """The sbatch options that make `job` wait for the jobs it depends on (by their ids)."""
    if not job.after:
        return []
    args = [f"--dependency={job.condition}:{':'.join(job_ids[kind] for kind in job.after)}"]
    return args + (["--kill-on-invalid-dep=yes"] if job.condition == "afterok" else [])


def submit_plan(loaded: LoadedRecipe, run_dir: Path, info: RunInfo, plan: list[JobSpec],
                on_submit: Callable[[JobRecord], None] = lambda record: None) -> RunInfo:
    """Submit every job of `plan` in order; each job's record goes to run.json as soon as it is submitted."""
    job_ids: dict[str, str] = {}
    try:
        for job in plan:
            sbatch_args = dependency_args(job, job_ids)
            executor = _executor(loaded, job.kind, run_dir, info.python, sbatch_args)
            task = resolve_task(job.task)
            if job.array_size:
                handle = executor.map_array(task, [str(run_dir)] * job.array_size, range(job.array_size))[0]
            else:
                handle = executor.submit(task, str(run_dir))
            job_ids[job.kind] = str(handle.job_id).split("_")[0]
            assert executor.submitted_text is not None
            write_private(script_file(run_dir, job.kind), executor.submitted_text)
            dependency = sbatch_args[0].split("=", 1)[1] if sbatch_args else None
            record = JobRecord(kind=job.kind, job_id=job_ids[job.kind], array_size=job.array_size,
                               dependency=dependency)
            info.jobs[job.kind] = record
            info.save()
            on_submit(record)
    except BaseException:
        if job_ids:
            commands.cancel(list(job_ids.values()))
        raise
    return info


def cancel_chain(info: RunInfo) -> list[str]:
    """scancel every job the run recorded; the ids cancelled."""
    ids = [r.job_id for r in info.jobs.values() if r.job_id]
    commands.cancel(ids)
    return ids
