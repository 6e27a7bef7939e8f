"""Submit a run's chain to Slurm: train -> eval array (afterok) -> report (afterany); an evaluation of a checkpoint
folder is export -> eval array (afterok) -> report (afterany).

With DependencyParameters=kill_invalid_depend (or --kill-on-invalid-dep=yes, which we pass),
a failed training job cancels the evaluation array instead of leaving it pending forever;
the report job still runs (afterany) and records why.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.launch.eval import eval_shard_task
from embodyhpc.launch.export import export_task
from embodyhpc.launch.report import report_task
from embodyhpc.launch.train import train_task
from embodyhpc.rundir import JobRecord, RunInfo, write_private
from embodyhpc.slurm import commands
from embodyhpc.slurm.executor import RecipeExecutor
from embodyhpc.slurm.render import chain_kinds, job_shape, render_job, submitit_folder


def _executor(loaded: LoadedRecipe, kind: str, run_dir: Path, python: str,
              sbatch_args: list[str]) -> RecipeExecutor:
    def script(command: str) -> str:
        return render_job(loaded, kind, run_dir, python, command=command)

    return RecipeExecutor(submitit_folder(run_dir), shape=job_shape(loaded, kind), script=script,
                          python=python, sbatch_args=sbatch_args,
                          max_num_timeout=loaded.config.resources.max_requeues)


def submit_chain(loaded: LoadedRecipe, run_dir: Path, info: RunInfo,
                 on_submit: Callable[[JobRecord], None] = lambda record: None, *, eval_only: bool = False) -> RunInfo:
    """Submit every job; if one submission fails, cancel the ones already submitted."""
    submitted: list[str] = []

    def submit(kind: str, sbatch_args: list[str], call: Callable[[RecipeExecutor], object],
               array_size: int = 0) -> str:
        executor = _executor(loaded, kind, run_dir, info.python, sbatch_args)
        result = call(executor)
        job = result[0] if isinstance(result, list) else result
        job_id = str(job.job_id).split("_")[0]
        submitted.append(job_id)
        assert executor.submitted_text is not None
        write_private(run_dir / "scripts" / f"{kind}.sbatch", executor.submitted_text)
        dependency = next((a.split("=", 1)[1] for a in sbatch_args if a.startswith("--dependency=")), None)
        record = JobRecord(kind=kind, job_id=job_id, array_size=array_size, dependency=dependency)
        info.jobs[kind] = record
        info.save()
        on_submit(record)
        return job_id

    kinds = chain_kinds(loaded, eval_only=eval_only)
    try:
        after: list[str] = []
        if "train" in kinds:
            after.append(submit("train", [], lambda ex: ex.submit(train_task, str(run_dir))))
        if "export" in kinds:
            after.append(submit("export", [], lambda ex: ex.submit(export_task, str(run_dir))))
        if "eval" in kinds:
            shards = loaded.config.eval.shards
            deps = [f"--dependency=afterok:{after[0]}", "--kill-on-invalid-dep=yes"] if after else []
            eval_id = submit("eval", deps,
                             lambda ex: ex.map_array(eval_shard_task, [str(run_dir)] * shards, range(shards)),
                             array_size=shards)
            after.append(eval_id)
        submit("report", [f"--dependency=afterany:{':'.join(after)}"],
               lambda ex: ex.submit(report_task, str(run_dir)))
    except BaseException:
        if submitted:
            commands.cancel(submitted)
        raise
    return info


def submit_smoke(loaded: LoadedRecipe, run_dir: Path, info: RunInfo) -> JobRecord:
    """One smoke job (embodyhpc.launch.smoke) on one node with the training job's resources."""
    from embodyhpc.launch.smoke import smoke_task

    executor = _executor(loaded, "smoke", run_dir, info.python, [])
    job = executor.submit(smoke_task, str(run_dir))
    assert executor.submitted_text is not None
    write_private(run_dir / "scripts" / "smoke.sbatch", executor.submitted_text)
    record = JobRecord(kind="smoke", job_id=str(job.job_id))
    info.jobs["smoke"] = record
    info.save()
    return record


def cancel_chain(info: RunInfo) -> list[str]:
    ids = [r.job_id for r in info.jobs.values() if r.job_id]
    commands.cancel(ids)
    return ids
