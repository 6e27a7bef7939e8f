"""Start, run and cancel chains: what `embodyhpc submit`/`eval`/`smoke --submit`/`cancel` and the training job
(evaluations of its checkpoints) call. The backend is the run's (run.json `backend`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.evaluate import evaluated_checkpoint
from embodyhpc.orchestrate.plan import chain_plan, smoke_plan
from embodyhpc.rundir import RESOLVED_YAML, JobRecord, RunInfo, requested_evals, write_private

Progress = Callable[[str], None]


def start_run(loaded: LoadedRecipe, run_dir: Path, *, backend: str, python: str, mlflow_run_id: str | None,
              parent_run: Path | None = None) -> RunInfo:
    """Fill a fresh run directory: resolved.yaml, run.json, and a pin on the checkpoint it evaluates (if any), so
    that the training run's retention keeps that checkpoint until the export job has read it."""
    write_private(run_dir / RESOLVED_YAML, loaded.to_yaml())
    info = RunInfo(run_id=run_dir.name, run_dir=str(run_dir), backend=backend, recipe=loaded.recipe,
                   site=loaded.site, overrides=list(loaded.overrides), python=python,
                   created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), mlflow_run_id=mlflow_run_id,
                   parent_run=str(parent_run) if parent_run else None)
    checkpoint = evaluated_checkpoint(loaded.config.eval)
    if checkpoint is not None:
        from embodyhpc.checkpoint import layout

        layout.pin(checkpoint, owner=run_dir)
    info.save()
    return info


def run_chain(loaded: LoadedRecipe, info: RunInfo, *, progress: Progress = print, eval_only: bool = False) -> RunInfo:
    """Submit the chain of a started run to Slurm, or run it on this machine (info.backend decides)."""
    run_dir = Path(info.run_dir)
    if info.backend == "slurm":
        from embodyhpc.orchestrate.backend_slurm import submit_plan

        return submit_plan(loaded, run_dir, info, chain_plan(loaded, eval_only=eval_only), on_submit=lambda r: progress(
            f"submitted {r.kind}: job {r.job_id}" + (f" ({r.dependency})" if r.dependency else "")))
    from embodyhpc.orchestrate.backend_local import run_local_chain

    return run_local_chain(loaded, run_dir, info, progress=progress, eval_only=eval_only)


def submit_smoke(loaded: LoadedRecipe, run_dir: Path, info: RunInfo) -> JobRecord:
    """One smoke job (embodyhpc.launch.smoke) on Slurm, on one node with the training job's resources."""
    from embodyhpc.orchestrate.backend_slurm import submit_plan

    submit_plan(loaded, run_dir, info, smoke_plan())
    return info.jobs["smoke"]


def cancel_run(run_dir: Path) -> str:
    """Cancel every job the run started: its chain, then the chains of its evaluations while training (under
    evals/, submitted from inside the training job) and their export jobs. Job ids are checked before scancel
    sees them (embodyhpc.rundir, embodyhpc.slurm.commands). Holds the run's lock meanwhile (embodyhpc.runlock)."""
    from embodyhpc.runlock import run_lock

    info = RunInfo.load(run_dir)
    if info.backend != "slurm":
        return "local runs stop with their `embodyhpc submit` process (Ctrl-C); nothing to cancel"
    with run_lock(info.run_dir, "embodyhpc cancel"):  # a resume or submit mid-way: refused, naming it
        return _cancel_locked(RunInfo.load(run_dir))  # read again: the holder before us may have added jobs


def _cancel_locked(info: RunInfo) -> str:
    from embodyhpc.errors import RunDirError
    from embodyhpc.orchestrate.backend_slurm import cancel_chain

    cancelled = cancel_chain(info)  # training first: it asks for no evaluation after this
    lines = [f"cancelled jobs {' '.join(cancelled) or '(none submitted)'}"]
    seen: set[Path] = set()
    damaged: list[RunDirError] = []
    for _ in range(2):  # again after the first pass: an evaluation asked for while training was being cancelled
        for path in requested_evals(Path(info.run_dir)):
            if path in seen:
                continue
            seen.add(path)
            try:
                ids = cancel_chain(RunInfo.load(path))
            except RunDirError as exc:
                damaged.append(exc)
                continue
            lines.append(f"cancelled evaluation {path.name}: jobs {' '.join(ids) or '(none submitted)'}")
    if damaged:  # what could be cancelled is; the rest needs the user (one line, exit 2)
        raise RunDirError(f"{lines[0]}; {len(damaged)} evaluation(s) not cancelled: {damaged[0].one_line()}")
    return "\n".join(lines)
