"""Start, run and cancel chains: what `embodyhpc submit`/`eval`/`smoke --submit`/`cancel`/`resume` and the training
job (evaluations of its checkpoints) call, and the one dry run (`submit --dry-run`, `resume --dry-run`).

A backend executes a plan (orchestrate.plan.Plan) and implements `Backend`; which one a run uses is run.json's
`backend`, looked up in BACKENDS (by import name: a Slurm run never imports the local backend, nor the other way).
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.evaluate import evaluated_checkpoint
from embodyhpc.orchestrate.plan import Plan, chain_plan
from embodyhpc.plugins import import_name
from embodyhpc.rundir import RESOLVED_YAML, requested_evals, write_private
from embodyhpc.runinfo import JobRecord, RunInfo

Progress = Callable[[str], None]


@runtime_checkable
class Backend(Protocol):
    """What executes a plan. `cancel_note`: None where `cancel` cancels; else why there is nothing to cancel."""

    cancel_note: str | None

    def submit(self, plan: Plan, info: RunInfo, progress: Progress) -> RunInfo:
        """Start every job of the plan (their records go to run.json); returns the run's record."""

    def poll(self, info: RunInfo) -> dict[str, str]:
        """Each job's state (by kind)."""

    def cancel(self, info: RunInfo) -> list[str]:
        """Stop every job the run recorded; the ids stopped."""


BACKENDS = {
    "slurm": "embodyhpc.orchestrate.backend_slurm:SlurmBackend",
    "local": "embodyhpc.orchestrate.backend_local:LocalBackend",
}


def backend(name: str) -> Backend:
    """The backend a run records (run.json `backend`: RunInfo.load accepts only the names BACKENDS holds)."""
    return import_name(BACKENDS[name])()


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


def run_chain(loaded: LoadedRecipe, info: RunInfo, *, progress: Progress = print, eval_only: bool = False,
              plan: Plan | None = None) -> RunInfo:
    """Hand the chain of a started run to its backend. `plan`: the chain as the caller made it already (submit and
    resume make it before the run folder changes, so that a broken template fails first); else it is made here
    (an evaluation of a checkpoint that training asks for)."""
    if plan is None:
        plan = chain_plan(loaded, Path(info.run_dir), info.python, eval_only=eval_only)
    return backend(info.backend).submit(plan, info, progress)


def submit_smoke(plan: Plan, info: RunInfo) -> JobRecord:
    """One smoke job (plan.smoke_plan) on Slurm, on one node with the training job's resources."""
    backend("slurm").submit(plan, info, lambda message: None)
    return info.jobs["smoke"]


@dataclass
class PlannedJob:
    """One job a dry run would hand to sbatch."""

    kind: str
    sbatch_args: list[str]
    """The options on sbatch's command line (dependencies on the placeholder ids `<train>`, `<eval>`, ...)."""
    script_path: str
    script: str


@dataclass
class DryRun:
    run_dir: str
    """The folder the jobs would run in."""
    jobs: list[PlannedJob]

    def text(self, header: str | None = None) -> str:
        out = [header or f"# dry run: nothing submitted; run directory would be {self.run_dir}"]
        for job in self.jobs:
            out.append(f"# sbatch {''.join(f'{arg} ' for arg in job.sbatch_args)}{shlex.quote(job.script_path)}")
            out.append(job.script)
        return "\n".join(out)


def dry_run(plan: Plan) -> DryRun:
    """What submitting `plan` would hand to sbatch: each job's command line and script; nothing is submitted."""
    from embodyhpc.orchestrate.backend_slurm import dependency_args

    placeholders = {job.kind: f"<{job.kind}>" for job in plan.jobs}  # the job ids sbatch would answer
    args = [dependency_args(job.spec, placeholders) for job in plan.jobs]
    return DryRun(str(plan.run_dir), [PlannedJob(job.kind, job_args, str(job.script_path), job.script)
                                      for job, job_args in zip(plan.jobs, args, strict=True)])


def cancel_run(run_dir: Path) -> str:
    """Cancel every job the run started: its chain, then the chains of its evaluations while training (under
    evals/, submitted from inside the training job) and their export jobs. Job ids are checked before scancel
    sees them (embodyhpc.rundir, embodyhpc.slurm.commands). Holds the run's lock meanwhile (embodyhpc.runlock)."""
    from embodyhpc.runlock import run_lock

    info = RunInfo.load(run_dir)
    note = backend(info.backend).cancel_note
    if note is not None:
        return note
    with run_lock(info.run_dir, "embodyhpc cancel"):  # a resume or submit mid-way: refused, naming it
        return _cancel_locked(RunInfo.load(run_dir))  # read again: the holder before us may have added jobs


def _cancel_locked(info: RunInfo) -> str:
    from embodyhpc.errors import RunDirError

    def cancel_chain(run: RunInfo) -> list[str]:
        return backend(run.backend).cancel(run)

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
