"""`embodyhpc resume RUN`: a stopped run goes on in its own folder, from its newest complete checkpoint.

A run stops for many reasons: its requeue budget ran out, it was cancelled, a node failed or ran out of memory, or
it finished and should train longer. Resume starts a new *attempt* of the same run:

- the newest complete checkpoint is the starting point; checkpoints reshard on load, so the attempt may run on
  another number of nodes or ranks, and the sampler deals the rest of the same sample order to the new ranks;
- run.json records the attempt (its overrides, the step it started from, its jobs; schema_version 3), and what the
  previous attempt left that the new one would overwrite moves to attempts/N (rundir.ATTEMPT_OUTPUTS) in one
  rename, a resume that dies half-way being finished or undone by the next (embodyhpc.attempts); an existing
  attempts/N is never overwritten (run.json restored from a backup: refused, naming it);
- resolved.yaml is rewritten with the new values (the old one is kept under attempts/N);
- the same MLflow run is reopened and goes on (one curve); logs/metrics.jsonl is cut back to the checkpoint's step
  by its writer, so each step is there once;
- the whole chain follows, as after `submit`: train -> eval array -> report.

What may change (embodyhpc.resume_checks): how and where it runs, never what it learns. Resources, parallelism
degrees and execution options, the micro-batch size (the global batch size stays, so the optimizer sees the same
batches), train.steps (raised: see below), logging and checkpoint cadence, the evaluation's resources, staging, the
network profile and site keys. Everything else (the model, the data, the optimizer and its schedule, the seed, the
precision, the run's name and store) would make the checkpoint a different run's and is refused, naming the key.

train.steps may be raised to train on. The learning-rate schedule is a function of (step, train.steps)
(embodyhpc.train.schedule): it is *stretched*, i.e. steps after the resume follow the warm-up + cosine a run
planned for the new train.steps from the start would have followed. The rate therefore jumps up at the resume step
(the cosine at K/new is above the cosine at K/old): plan train.steps ahead when that matters.

One command at a time: `resume` holds the run's lock (embodyhpc.runlock) from reading run.json until its chain is
submitted (a chain run here: until it ends); a second resume, a cancel or an evaluation of the run started
meanwhile is refused on one line naming the holder. `--dry-run` changes nothing and takes no lock.

What a resume trusts, and what it checks (decisions where a run folder was changed by hand):
- the checkpoint: its step is the one its marker and trainer.json record, and a folder whose name says another is
  refused (embodyhpc.checkpoint.layout.checkpoint_step); a complete checkpoint under a name that is no step folder
  (`step-0004`) is refused with its true name rather than passed over;
- a step folder that is a symbolic link leading out of checkpoints/ is refused: the job would train on from another
  run's folder, and retention and pins would act there (copy it in with `cp -rL`, or resume the run it belongs
  to). checkpoints/ itself may be a link (to scratch storage);
- resolved.yaml: the model it describes must fit the checkpoint (names, shapes and kinds of the model's tensors
  against the DCP metadata, embodyhpc.checkpoint.export.check_fits): a hand-edited model section is refused naming
  resolved.yaml. Other hand edits cannot be checked against the checkpoint and become the run's values;
- site keys: with --site, the keys only a site profile may set (site.python, templates, container, modules,
  secrets, code-loading environment variables) are dropped from resolved.yaml and taken from the profile given, as
  `eval --ckpt` does for a config it did not write; without --site the run keeps its own.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embodyhpc import attempts
from embodyhpc.config.load import LoadedRecipe, resolve_located
from embodyhpc.config.schema import Config
from embodyhpc.errors import RunDirError, RunFailure, UserError
from embodyhpc.resume_checks import (
    changed_values,
    check_batch,
    check_model,
    check_steps,
    exclude_override,
    refused_key,
    resumable,
    target_steps,
    where_set,
)
from embodyhpc.rundir import (
    CHECKPOINTS_DIR,
    RESOLVED_YAML,
    RUN_JSON,
    RUN_JSON_VERSION,
    SPINE_STATE_FILE,
    script_file,
    write_private,
)
from embodyhpc.runinfo import RunInfo
from embodyhpc.runlock import RunLock, run_lock
from embodyhpc.validation import load_config_file, load_unresolved

Progress = Callable[[str], None]

TRAINING_JOBS = ("train", "rl")  # the job a resume starts again: a training run's, an RL run's
_LOCAL_ACTIVE = ("PENDING", "RUNNING")
_SITE_ENV = "EMBODYHPC_SITE"


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """Everything checked, nothing changed yet."""

    info: RunInfo
    loaded: LoadedRecipe
    from_step: int
    overrides: list[str]
    """What the attempt records: the user's key=value, then site.exclude when --exclude added nodes."""
    changed: dict[str, tuple[Any, Any]]
    """key -> (old, new) for every value that differs from the previous attempt."""
    warnings: list[str]


def lock_run(run_dir: Path, progress: Progress = print) -> RunLock:
    """The run's lock for `with lock_run(run): plan_resume(..., recover=True); resume(...)` (embodyhpc.runlock).
    A folder that is no run is refused first (its one line), so that no lock file is made in it."""
    info = RunInfo.load(run_dir)
    return run_lock(info.run_dir, "embodyhpc resume", progress=progress)


def plan_resume(run_dir: Path, overrides: list[str], *, site: str | None = None, exclude: str | None = None,
                check_jobs: bool = True, recover: bool = False, progress: Progress = print) -> ResumePlan:
    """Check that `run_dir` may resume with these overrides; raise a one-line UserError when not.

    recover: finish or undo what a resume that died half-way left (embodyhpc.attempts.recover, saying so through
    `progress`) first; only under the run's lock (lock_run). Without it such leftovers are refused (a dry run
    changes nothing)."""
    info = RunInfo.load(run_dir)  # unknown folder, no run.json, damaged run.json: one line each
    run = Path(info.run_dir)
    if info.schema_version > RUN_JSON_VERSION:
        raise RunDirError(f"run.json has schema_version {info.schema_version}, newer than this embodyhpc's "
                          f"({RUN_JSON_VERSION}); resuming would rewrite it and drop what this version does not "
                          "know", where=str(run / RUN_JSON), fix="resume with the newer embodyhpc that wrote it")
    if info.parent_run is not None or not any(kind in a.jobs for a in info.all_attempts() for kind in TRAINING_JOBS):
        raise RunDirError("not a training run (an evaluation or smoke run has nothing to resume)", where=str(run),
                          fix="pass the training run's folder; `embodyhpc eval --ckpt` evaluates again")
    for text in overrides:
        key = text.partition("=")[0]
        if "=" in text and key and not resumable(key):
            raise refused_key(key, f"override {text[:100]!r}")
    warnings: list[str] = []
    if check_jobs:
        warnings += _check_nothing_runs(info)
    left = attempts.pending(run)
    if left and not recover:
        raise RunDirError("a resume stopped half-way and left this staging folder", where=str(left[0]),
                          fix=f"`embodyhpc resume {shlex.quote(str(run))}` without --dry-run finishes or undoes it "
                              "first")
    if left:
        attempts.recover(run, info.attempt, progress)
    attempts.check_free(run, info.attempt)
    old = load_config_file(run / RESOLVED_YAML)
    from_step = newest_checkpoint_step(run, old)
    if from_step is None:
        raise RunDirError("no complete checkpoint to resume from (training stopped before its first save)",
                          where=str(run / CHECKPOINTS_DIR),
                          fix=f"`embodyhpc submit {shlex.quote(info.recipe)}` starts the run fresh")
    extra = exclude_override(old, exclude) if exclude is not None else []
    all_overrides = [*overrides, *extra]
    config, provenance, _, site_name = _load(run, all_overrides, site)
    changed = changed_values(old, config)
    for key in changed:
        if not resumable(key):
            where = where_set(key, provenance)
            raise refused_key(key, where)
    check_steps(config, old, from_step, provenance, run)
    if not config.rl.enabled:  # an RL run's batch against its actor ranks: validation/rl_checks.py, at load
        check_batch(config, provenance)
    resolved = resolve_located(config, provenance)
    check_model(run, from_step, config)
    loaded = LoadedRecipe(config=config, resolved=resolved, recipe=info.recipe, site=site_name or info.site,
                          overrides=tuple(all_overrides), provenance=provenance)
    return ResumePlan(info, loaded, from_step, all_overrides, changed, warnings)


def newest_checkpoint_step(run: Path, config: Config) -> int | None:
    """The step of the newest complete checkpoint (the policy trainer's DCP folders; the synthetic stand-in's state
    file), or None. The step is the one the checkpoint records (layout.checkpoint_step); a complete checkpoint
    under a near-miss name and a step folder linking out of checkpoints/ are refused (module docstring)."""
    from embodyhpc.checkpoint import layout

    root = run / CHECKPOINTS_DIR
    listing = layout.list_steps(root)
    for name in listing.misnamed:
        if layout.is_complete(root / name):
            raise RunDirError(f"a complete checkpoint under a name that is no step folder: "
                              f"{layout.misnamed_step(name)}", where=str(root / name),
                              fix="rename it as embodyhpc names step folders (step-N), or move it out of "
                                  f"{CHECKPOINTS_DIR}/")
    step = listing.newest_complete
    if step is not None:
        folder = layout.step_dir(root, step)
        target = folder.resolve()
        if folder.is_symlink() and not target.is_relative_to(root.resolve()):
            raise RunDirError(f"a symbolic link to {target}, outside the run's {CHECKPOINTS_DIR}/: a resume trains "
                              "on from the run's own checkpoints only (retention and pins would act on the other "
                              "folder)", where=str(folder),
                              fix=f"copy it in (rm {folder}; cp -rL {target} {folder}), or resume the run it "
                                  "belongs to")
        return layout.checkpoint_step(folder)
    if config.data.format != "synthetic":
        return None
    spine = run / SPINE_STATE_FILE
    if not spine.is_file():
        return None
    import torch

    try:
        return int(torch.load(spine, weights_only=True)["step"])
    except Exception as exc:  # noqa: BLE001 - a damaged state file: say so, one line
        raise RunDirError(f"the stand-in's checkpoint is unreadable: {type(exc).__name__}", where=str(spine),
                          fix="`embodyhpc submit` starts the run fresh") from exc


def _load(run: Path, overrides: list[str], site: str | None) -> tuple[Config, dict[str, str], str, str | None]:
    """The previous attempt's resolved.yaml, the site profile given now, then the overrides. With a profile, the
    keys only a site profile may set are dropped from resolved.yaml and the profile's (or their defaults) apply, as
    `eval --ckpt` does; without one ($EMBODYHPC_SITE is not applied either) the run keeps its own site values."""
    saved = os.environ.pop(_SITE_ENV, None) if site is None else None
    try:
        return load_unresolved(str(run / RESOLVED_YAML), overrides, site,
                               recipe_site_keys="keep" if site is None else "drop")
    finally:
        if saved is not None:
            os.environ[_SITE_ENV] = saved


# ---- is anything of the run still queued or running? ----
def _check_nothing_runs(info: RunInfo) -> list[str]:
    """Refuse while a job of the newest attempt is queued or running (two trainings would write one checkpoint
    folder). Returns warnings."""
    if info.backend == "local":
        for record in info.jobs.values():
            if record.state in _LOCAL_ACTIVE and _local_alive(record.element_ids or [record.job_id]):
                raise UserError(f"the run is still running on this machine: {record.kind} (process "
                                f"{record.job_id}) is {record.state}", where=info.run_dir,
                                fix="wait for its `embodyhpc submit` to end, or stop it (Ctrl-C) first")
        return []
    from embodyhpc.slurm.status import read_states

    (statuses,), from_disk = read_states([info])
    if from_disk is not None:
        raise UserError(f"cannot tell whether its jobs still run: sacct failed ({from_disk})", where=info.run_dir,
                        fix="resume once Slurm answers (`embodyhpc status RUN` shows the same)")
    warnings = []
    for status in statuses:
        if status.state == "UNKNOWN":
            warnings.append(f"Slurm has no record of {status.kind} job {status.job_id}; taken as ended")
        elif not status.finished:
            raise UserError(f"the run is still in the queue or running: {status.kind} job {status.job_id} is "
                            f"{status.state}", where=info.run_dir,
                            fix=f"wait for it, or `embodyhpc cancel {shlex.quote(info.run_dir)}` first")
    return warnings


def _local_alive(pids: list[str | None]) -> bool:
    """A local job's processes (submitit's local executor: the job id is the pid) still exist and are submitit's."""
    for pid in pids:
        if not pid or not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"submitit" in cmdline:
            return True
    return False


# ---- doing it ----
def resume(plan: ResumePlan, python: str, *, local: bool = False, progress: Progress = print,
           lock: RunLock | None = None) -> RunInfo:
    """Start the new attempt (begin_attempt) and submit the chain (Slurm when reachable, else locally). `lock`
    (lock_run, held since the plan was made) turns shared while a chain runs here: evaluations of the run may go on
    beside it, another resume may not."""
    from embodyhpc.orchestrate.api import run_chain
    from embodyhpc.orchestrate.plan import chain_plan

    chain = chain_plan(plan.loaded, Path(plan.info.run_dir), python)  # a broken template fails before any change
    loaded, info = begin_attempt(plan, python, local=local, progress=progress)
    if lock is not None and info.backend == "local":
        lock.share()
    return run_chain(loaded, info, progress=progress, plan=chain)


def begin_attempt(plan: ResumePlan, python: str, *, local: bool = False,
                  progress: Progress = print) -> tuple[LoadedRecipe, RunInfo]:
    """Everything a resume does before its chain starts: choose the backend, archive what the last attempt left
    (embodyhpc.attempts: staged, then one rename), rewrite resolved.yaml and run.json, reopen the MLflow run (the
    values after the checkpoint dropped). Returns the recipe and the run's record for the chain."""
    from embodyhpc.submit import prepare_launch

    loaded, backend = prepare_launch(plan.loaded, python, local=local, progress=progress, warnings=plan.warnings)
    info = plan.info
    run = Path(info.run_dir)
    number = info.attempt
    nothing_changed = f"{run}: nothing changed (attempt {number}'s outputs and resolved.yaml are in place)"
    try:
        staging = attempts.stage(run, number)
    except OSError as exc:
        raise RunFailure(f"{nothing_changed}: archiving them failed ({_os_error(exc)})") from exc
    try:
        write_private(run / RESOLVED_YAML, loaded.to_yaml())
        info.start_attempt(backend=backend, site=loaded.site, python=python, overrides=list(plan.overrides),
                           resumed_from_step=plan.from_step, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        info.save()  # the commit: from here on the run is at attempt number + 1
    except BaseException as exc:
        attempts.put_back(run, staging)
        if isinstance(exc, OSError):
            raise RunFailure(f"{nothing_changed}: recording attempt {number + 1} failed ({_os_error(exc)})") from exc
        raise
    try:
        moved = f"attempt {number}'s outputs moved to {attempts.commit(run, number, staging)}"
    except (OSError, RunDirError) as exc:  # they are safe where they are; the next resume finishes the move
        moved = f"warning: attempt {number}'s outputs stay in {staging} for now ({_os_error(exc)})"
    script_file(run, "train").parent.mkdir(mode=0o700, exist_ok=True)
    key, steps = target_steps(loaded.config)
    progress(f"attempt {info.attempt} of {run}: from the checkpoint of step {plan.from_step} to "
             f"{key}={steps} on {_ranks(loaded)}; {moved}")
    _reopen_mlflow(loaded, info, progress)
    return loaded, info


def _ranks(loaded: LoadedRecipe) -> str:  # what the attempt runs on: training's ranks, an RL run's roles
    rl = loaded.config.rl
    return rl.processes() if rl.enabled else f"{loaded.resolved.world_size} rank(s)"


def _os_error(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")
    return exc.one_line() if isinstance(exc, UserError) else str(exc)


def _reopen_mlflow(loaded: LoadedRecipe, info: RunInfo, progress: Progress) -> None:
    cfg = loaded.config
    if not (cfg.tracking.enabled and info.mlflow_run_id):
        return
    from embodyhpc.tracking.mlflow_run import TrackingError, tracking_uri
    from embodyhpc.tracking.reopen import reopen_run

    uri = tracking_uri(cfg.tracking, cfg.job.runs_root)
    try:
        reopened = reopen_run(uri, info.mlflow_run_id, after_step=info.resumed_from_step)
    except TrackingError as exc:  # as at submit: the dashboards are lost, not the run
        progress(f"warning: MLflow run {info.mlflow_run_id} not reopened, its jobs log what they can: {exc}")
        return
    dropped = (f"; {reopened.removed} value(s) after step {info.resumed_from_step} that no checkpoint holds dropped "
               "(this attempt logs those steps again)" if reopened.removed else "")
    progress(f"MLflow run {info.mlflow_run_id} goes on (was {reopened.previous_status}){dropped}")
    if reopened.kept_steps:
        steps = reopened.kept_steps
        progress(f"warning: the MLflow server keeps the stopped attempt's values of steps {steps[0]}-{steps[-1]} "
                 "(MLflow has no call that deletes a value): those steps will show two values there; "
                 "logs/metrics.jsonl holds each once")


def dry_run(plan: ResumePlan, python: str) -> str:
    """What `resume` would do and the scripts it would hand to sbatch (orchestrate.api.dry_run); nothing changes."""
    from embodyhpc.orchestrate.api import dry_run as preview
    from embodyhpc.orchestrate.plan import chain_plan

    loaded = plan.loaded
    run = Path(plan.info.run_dir)
    key, steps = target_steps(loaded.config)
    header = [f"# dry run: nothing submitted; attempt {plan.info.attempt + 1} of {run} would start from the "
              f"checkpoint of step {plan.from_step} and train to {key}={steps} on {_ranks(loaded)}"]
    header += [f"#   {key}: {old!r} -> {new!r}" for key, (old, new) in plan.changed.items()]
    return preview(chain_plan(loaded, run, python)).text(header="\n".join(header))
