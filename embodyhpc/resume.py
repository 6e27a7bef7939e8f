"""`embodyhpc resume RUN`: a stopped run goes on in its own folder, from its newest complete checkpoint.

A run stops for many reasons: its requeue budget ran out, it was cancelled, a node failed or ran out of memory, or
it finished and should train longer. Resume starts a new *attempt* of the same run:

- the newest complete checkpoint is the starting point; checkpoints reshard on load, so the attempt may run on
  another number of nodes or ranks, and the sampler deals the rest of the same sample order to the new ranks;
- run.json records the attempt (its overrides, the step it started from, its jobs; schema_version 3), and what the
  previous attempt left that the new one would overwrite moves to attempts/N (rundir.ATTEMPT_OUTPUTS);
- resolved.yaml is rewritten with the new values (the old one is kept under attempts/N);
- the same MLflow run is reopened and goes on (one curve); logs/metrics.jsonl is cut back to the checkpoint's step
  by its writer, so each step is there once;
- the whole chain follows, as after `submit`: train -> eval array -> report.

What may change (RESUMABLE_KEYS): how and where it runs, never what it learns. Resources, parallelism degrees and
execution options, the micro-batch size (the global batch size stays, so the optimizer sees the same batches),
train.steps (raised: see below), logging and checkpoint cadence, the evaluation's resources, staging, the network
profile and site keys. Everything else (the model, the data, the optimizer and its schedule, the seed, the
precision, the run's name and store) would make the checkpoint a different run's and is refused, naming the key.

train.steps may be raised to train on. The learning-rate schedule is a function of (step, train.steps)
(embodyhpc.train.schedule): it is *stretched*, i.e. steps after the resume follow the warm-up + cosine a run
planned for the new train.steps from the start would have followed. The rate therefore jumps up at the resume step
(the cosine at K/new is above the cosine at K/old): plan train.steps ahead when that matters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embodyhpc.config.load import LoadedRecipe, load_config_file, load_unresolved, resolve_located
from embodyhpc.config.schema import Config
from embodyhpc.errors import ConfigError, RunDirError, UserError
from embodyhpc.rundir import (
    ATTEMPT_OUTPUTS,
    CHECKPOINTS_DIR,
    RESOLVED_YAML,
    RUN_JSON,
    RUN_JSON_VERSION,
    SPINE_STATE_FILE,
    RunInfo,
    attempt_dir,
    script_file,
    write_private,
)

Progress = Callable[[str], None]

RESUMABLE_KEYS = (
    "resources", "parallelism", "train.steps", "train.micro_batch_size", "train.log_every", "staging", "network",
    "site", "data.num_workers", "data.prefetch_factor", "checkpoint.every_steps", "checkpoint.keep_latest_k",
    "checkpoint.async_save", "checkpoint.export_final", "eval.shards", "eval.array_parallelism",
    "eval.cpus_per_task", "eval.gpus_per_task", "eval.envs_per_shard", "eval.mem", "eval.time",
    "tracking.telemetry_interval_s",
)
"""Keys (and sections) a resume may change: how and where the run trains, not what it learns."""

_WHY_REFUSED = {
    "model": "the model's shapes are in the checkpoint",
    "data": "the data order and what each sample holds are in the checkpoint",
    "train": "the optimizer, its schedule and the global batch are the run's",
    "precision": "the precision decides the model's layers and the optimizer's numbers",
    "job": "the run stays in its folder and keeps its name",
    "tracking": "the MLflow run goes on in the same store",
    "checkpoint": "it is the run's",
    "eval": "the evaluation after training is the run's (`embodyhpc eval --ckpt` evaluates with other settings)",
}
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


def resumable(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in RESUMABLE_KEYS)


def refused_key(key: str, where: str) -> ConfigError:
    why = _WHY_REFUSED.get(key.split(".")[0], "it is part of what the checkpoint holds")
    return ConfigError(f"cannot change on resume: {why}", where=where, key=key,
                       fix="drop it (`embodyhpc submit` starts a new run with it); a resume may change "
                           "resources, parallelism, micro-batch size, train.steps, site and staging")


def plan_resume(run_dir: Path, overrides: list[str], *, site: str | None = None, exclude: str | None = None,
                check_jobs: bool = True) -> ResumePlan:
    """Check that `run_dir` may resume with these overrides; raise a one-line UserError when not."""
    info = RunInfo.load(run_dir)  # unknown folder, no run.json, damaged run.json: one line each
    run = Path(info.run_dir)
    if info.schema_version > RUN_JSON_VERSION:
        raise RunDirError(f"run.json has schema_version {info.schema_version}, newer than this embodyhpc's "
                          f"({RUN_JSON_VERSION}); resuming would rewrite it and drop what this version does not "
                          "know", where=str(run / RUN_JSON), fix="resume with the newer embodyhpc that wrote it")
    if info.parent_run is not None or not any("train" in a.jobs for a in info.all_attempts()):
        raise RunDirError("not a training run (an evaluation or smoke run has nothing to resume)", where=str(run),
                          fix="pass the training run's folder; `embodyhpc eval --ckpt` evaluates again")
    for text in overrides:
        key = text.partition("=")[0]
        if "=" in text and key and not resumable(key):
            raise refused_key(key, f"override {text[:100]!r}")
    warnings: list[str] = []
    if check_jobs:
        warnings += _check_nothing_runs(info)
    old = load_config_file(run / RESOLVED_YAML)
    from_step = newest_checkpoint_step(run, old)
    if from_step is None:
        raise RunDirError("no complete checkpoint to resume from (training stopped before its first save)",
                          where=str(run / CHECKPOINTS_DIR),
                          fix=f"`embodyhpc submit {shlex.quote(info.recipe)}` starts the run fresh")
    extra = _exclude_override(old, exclude) if exclude is not None else []
    all_overrides = [*overrides, *extra]
    config, provenance, _, site_name = _load(run, all_overrides, site)
    changed = _changed(old, config)
    for key in changed:
        if not resumable(key):
            where = _provenance(key, provenance)
            raise refused_key(key, where)
    _check_steps(config, old, from_step, provenance)
    _check_batch(config, provenance)
    resolved = resolve_located(config, provenance)
    loaded = LoadedRecipe(config=config, resolved=resolved, recipe=info.recipe, site=site_name or info.site,
                          overrides=tuple(all_overrides), provenance=provenance)
    return ResumePlan(info, loaded, from_step, all_overrides, changed, warnings)


def newest_checkpoint_step(run: Path, config: Config) -> int | None:
    """The step of the newest complete checkpoint (the policy trainer's DCP folders; the synthetic stand-in's state
    file), or None."""
    from embodyhpc.checkpoint.layout import list_steps

    step = list_steps(run / CHECKPOINTS_DIR).newest_complete
    if step is not None or config.data.format != "synthetic":
        return step
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
    """The previous attempt's resolved.yaml (site keys kept), the site profile given now (none: $EMBODYHPC_SITE is
    not applied either, the run keeps its own site values), then the overrides."""
    saved = os.environ.pop(_SITE_ENV, None) if site is None else None
    try:
        return load_unresolved(str(run / RESOLVED_YAML), overrides, site, recipe_site_keys="keep")
    finally:
        if saved is not None:
            os.environ[_SITE_ENV] = saved


def _provenance(key: str, provenance: dict[str, str]) -> str:
    while key:
        if key in provenance:
            return provenance[key]
        key = key.rpartition(".")[0]
    return "the site profile"


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def _changed(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    before, after = _flat(dataclasses.asdict(old)), _flat(dataclasses.asdict(new))
    return {key: (before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key)}


def _check_steps(new: Config, old: Config, from_step: int, provenance: dict[str, str]) -> None:
    steps = new.train.steps
    where = _provenance("train.steps", provenance)
    if from_step >= steps and steps == old.train.steps:
        raise ConfigError(f"already trained to train.steps={steps}; pass train.steps=M to continue (M > {steps}, "
                          f"e.g. train.steps={2 * steps})", where=where, key="train.steps",
                          fix="or evaluate it again with `embodyhpc eval --ckpt RUN`")
    if steps < from_step:
        raise ConfigError(f"train.steps={steps} is below the step the newest checkpoint holds ({from_step})",
                          where=where, key="train.steps", fix=f"pass train.steps={from_step + 1} or more")
    if steps == from_step:
        raise ConfigError(f"train.steps={steps} is the step the newest checkpoint holds: nothing to train",
                          where=where, key="train.steps", fix=f"pass train.steps={from_step + 1} or more")


def _check_batch(new: Config, provenance: dict[str, str]) -> None:
    """The global batch size stays: the new world and micro-batch size must divide it (resolve() says the same for
    submit, where changing the global batch is the fix; here it is not)."""
    train, world = new.train, new.resources.world_size
    gbs, micro = train.global_batch_size, train.micro_batch_size
    if gbs % (micro * world) == 0:
        return
    def best_micro(ranks: int) -> int:  # the largest micro-batch that fits, preferring no larger than now
        fits = [m for m in range(1, gbs // ranks + 1) if gbs % (m * ranks) == 0]
        return max((m for m in fits if m <= micro), default=max(fits))

    worlds = [w for w in range(1, gbs + 1) if gbs % w == 0]
    below = max((w for w in worlds if w < world), default=None)
    above = min((w for w in worlds if w > world), default=None)
    near = " or ".join(f"{w} ranks (micro_batch_size={best_micro(w)})" for w in (below, above) if w is not None)
    micros = [m for m in range(1, gbs // world + 1) if gbs % (m * world) == 0] if gbs % world == 0 else []
    options = []
    if near:
        options.append(f"{near} in all (resources.nodes x tasks per node)")
    if micros:
        options.append(f"train.micro_batch_size={max(micros)} on {world} ranks (any of {', '.join(map(str, micros))})")
    raise ConfigError(f"train.global_batch_size={gbs} stays on resume, and {world} ranks x micro_batch_size={micro} "
                      "do not divide it", where=_provenance("resources.nodes", provenance),
                      key="train.micro_batch_size" if micros else "resources.nodes",
                      fix="; or ".join(options) or f"no world size divides {gbs}")


def split_nodes(text: str) -> list[str]:
    """`n1,n2,gpu-[01,03]`: commas separate nodes, except inside a hostlist range's brackets."""
    return [part.strip() for part in re.split(r",(?![^\[]*\])", text) if part.strip()]


def _exclude_override(old: Config, exclude: str) -> list[str]:
    nodes = split_nodes(exclude)
    if not nodes:
        raise UserError("names no node", key="--exclude", fix="e.g. --exclude n3 or --exclude n3,gpu-[07-08]")
    from embodyhpc.config import checks

    try:
        checks.node_names("--exclude", nodes)
    except ConfigError as exc:
        raise UserError(exc.message, key="--exclude", fix=exc.fix) from None
    merged = list(dict.fromkeys([*old.site.exclude, *nodes]))
    return [f"site.exclude={json.dumps(merged)}"]


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
def resume(plan: ResumePlan, python: str, *, local: bool = False, progress: Progress = print) -> RunInfo:
    """Start the new attempt: archive what the last one left, rewrite resolved.yaml and run.json, reopen the MLflow
    run, and submit the chain (Slurm when reachable, else locally)."""
    from embodyhpc.orchestrate.api import run_chain
    from embodyhpc.submit import prepare_launch

    loaded, backend = prepare_launch(plan.loaded, python, local=local, progress=progress, warnings=plan.warnings)
    info = plan.info
    run = Path(info.run_dir)
    archived = archive_attempt(run, info.attempt)
    write_private(run / RESOLVED_YAML, loaded.to_yaml())
    info.start_attempt(backend=backend, site=loaded.site, python=python, overrides=list(plan.overrides),
                       resumed_from_step=plan.from_step, created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    info.save()
    progress(f"attempt {info.attempt} of {run}: from the checkpoint of step {plan.from_step} to "
             f"train.steps={loaded.config.train.steps} on {loaded.resolved.world_size} rank(s)"
             + (f"; attempt {info.attempt - 1}'s outputs moved to {archived}" if archived else ""))
    _reopen_mlflow(loaded, info, progress)
    return run_chain(loaded, info, progress=progress)


def archive_attempt(run: Path, number: int) -> Path | None:
    """Move what attempt `number` left that the next one would overwrite to attempts/<number>/ (same relative
    paths); the run's folders the jobs expect stay. None when there was nothing to move."""
    target = attempt_dir(run, number)
    moved = False
    for name in ATTEMPT_OUTPUTS:
        source = run / name
        if not (source.exists() or source.is_symlink()):
            continue
        if name == RESOLVED_YAML:  # the jobs of the new attempt read the rewritten one; keep a copy
            (target).mkdir(parents=True, exist_ok=True, mode=0o700)
            write_private(target / name, source.read_text())
        else:
            (target / name).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            source.rename(target / name)
        moved = True
    script_file(run, "train").parent.mkdir(mode=0o700, exist_ok=True)
    return target if moved else None


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
    """What `resume` would do and the scripts it would hand to sbatch; nothing changes."""
    from embodyhpc.orchestrate.plan import chain_plan
    from embodyhpc.slurm.render import render_job

    loaded = plan.loaded
    run = Path(plan.info.run_dir)
    out = [f"# dry run: nothing submitted; attempt {plan.info.attempt + 1} of {run} would start from the "
           f"checkpoint of step {plan.from_step} and train to train.steps={loaded.config.train.steps} on "
           f"{loaded.resolved.world_size} rank(s)"]
    out += [f"#   {key}: {old!r} -> {new!r}" for key, (old, new) in plan.changed.items()]
    for job in chain_plan(loaded):
        out.append(f"# sbatch {shlex.quote(str(script_file(run, job.kind)))}")
        out.append(render_job(loaded, job.kind, run, python))
    return "\n".join(out)
