"""What a resume may change, and whether the changed values still fit the run: the keys a resume may set
(RESUMABLE_KEYS, each refusal naming why), the step it trains to against the newest checkpoint, the model against
the checkpoint's tensors, the kept global batch against the new world size, --exclude's nodes. Pure checks on
configs and checkpoint metadata, used by embodyhpc.resume's plan_resume; nothing here changes a run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from embodyhpc.config.load import config_data
from embodyhpc.config.schema import Config
from embodyhpc.errors import ConfigError, RunDirError, UserError
from embodyhpc.rundir import CHECKPOINTS_DIR, RESOLVED_YAML, step_name

RESUMABLE_KEYS = (
    "resources", "parallelism", "train.steps", "train.micro_batch_size", "train.log_every", "staging", "network",
    "site", "data.num_workers", "data.prefetch_factor", "checkpoint.every_steps", "checkpoint.keep_latest_k",
    "checkpoint.async_save", "checkpoint.export_final", "eval.shards", "eval.array_parallelism",
    "eval.cpus_per_task", "eval.gpus_per_task", "eval.envs_per_shard", "eval.mem", "eval.time",
    "tracking.telemetry_interval_s",
    "rl.resources", "rl.iterations", "rl.actor_ranks", "rl.rollout_workers", "rl.env_workers", "rl.envs_per_worker",
    "rl.micro_batch_size", "rl.queue_depth", "rl.peer_timeout_s",
)
"""Keys (and sections) a resume may change: how and where the run trains, not what it learns (an RL run: its
processes, not its algorithm; its versions are its steps, rl.iterations raised like train.steps)."""

_WHY_REFUSED = {
    "model": "the model's shapes are in the checkpoint",
    "data": "the data order and what each sample holds are in the checkpoint",
    "train": "the optimizer, its schedule and the global batch are the run's",
    "precision": "the precision decides the model's layers and the optimizer's numbers",
    "job": "the run stays in its folder and keeps its name",
    "tracking": "the MLflow run goes on in the same store",
    "checkpoint": "it is the run's",
    "eval": "the evaluation after training is the run's (`embodyhpc eval --ckpt` evaluates with other settings)",
    "rl": "the algorithm, its samples and its hyper-parameters are what the policy learns with",
}


def resumable(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in RESUMABLE_KEYS)


def refused_key(key: str, where: str) -> ConfigError:
    why = _WHY_REFUSED.get(key.split(".")[0], "it is part of what the checkpoint holds")
    return ConfigError(f"cannot change on resume: {why}", where=where, key=key,
                       fix="drop it (`embodyhpc submit` starts a new run with it); a resume may change "
                           "resources, parallelism, micro-batch size, train.steps, site and staging")


def where_set(key: str, provenance: dict[str, str]) -> str:
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


def changed_values(old: Config, new: Config) -> dict[str, tuple[Any, Any]]:
    before, after = _flat(config_data(old)), _flat(config_data(new))  # recipe keys: rl.async, not rl.async_
    return {key: (before.get(key), after.get(key)) for key in sorted(set(before) | set(after))
            if before.get(key) != after.get(key)}


def target_steps(config: Config) -> tuple[str, int]:
    """(the key, its value) of the step a run trains to: rl.iterations for an RL run (its policy versions are its
    checkpoints' steps), else train.steps."""
    return ("rl.iterations", config.rl.iterations) if config.rl.enabled else ("train.steps", config.train.steps)


def check_steps(new: Config, old: Config, from_step: int, provenance: dict[str, str], run: Path) -> None:
    key, steps = target_steps(new)
    old_steps = target_steps(old)[1]
    where = where_set(key, provenance)
    if from_step > old_steps and steps <= from_step:
        raise ConfigError(f"the newest checkpoint holds step {from_step}, past the {key}={old_steps} "
                          "resolved.yaml says this run trains to (a resolved.yaml older than the checkpoints, or "
                          "another run's checkpoint copied in)", where=str(run / RESOLVED_YAML), key=key,
                          fix=f"pass {key}={from_step + 1} or more to train on from it, or move "
                              f"{run / CHECKPOINTS_DIR / step_name(from_step)} out of {CHECKPOINTS_DIR}/")
    if from_step >= steps and steps == old_steps:
        raise ConfigError(f"already trained to {key}={steps}; pass {key}=M to continue (M > {steps}, "
                          f"e.g. {key}={2 * steps})", where=where, key=key,
                          fix="or evaluate it again with `embodyhpc eval --ckpt RUN`")
    if steps < from_step:
        raise ConfigError(f"{key}={steps} is below the step the newest checkpoint holds ({from_step})",
                          where=where, key=key, fix=f"pass {key}={from_step + 1} or more")
    if steps == from_step:
        raise ConfigError(f"{key}={steps} is the step the newest checkpoint holds: nothing to train",
                          where=where, key=key, fix=f"pass {key}={from_step + 1} or more")


def check_model(run: Path, step: int, config: Config) -> None:
    """The model resolved.yaml describes must fit the checkpoint it trains on from (a hand-edited model section
    would fail in the job, after the queue): names, shapes and kinds of the model's tensors against the DCP
    metadata. The synthetic stand-in's state file holds no model of ours: nothing to compare."""
    from embodyhpc.checkpoint import layout

    folder = layout.step_dir(run / CHECKPOINTS_DIR, step)
    if not folder.is_dir():
        return
    from embodyhpc.checkpoint.errors import NotACheckpointError
    from embodyhpc.checkpoint.export import check_fits, model_entries

    try:
        entries = model_entries(folder)
    except NotACheckpointError as exc:
        raise RunDirError(f"the checkpoint to resume from is damaged: {exc.message}", where=str(folder),
                          fix=f"move it out of {CHECKPOINTS_DIR}/ to resume from the one before") from None
    where = str(run / RESOLVED_YAML)
    try:
        check_fits(entries, config.model, where=where, built_with=RESOLVED_YAML)
    except NotACheckpointError as exc:
        raise ConfigError(f"the model does not fit the checkpoint of step {step}: {exc.message}", where=where,
                          key="model", fix="put back the model section the run was trained with (attempts/N/"
                                           f"{RESOLVED_YAML} keeps each earlier attempt's); another model is a "
                                           "new run (`embodyhpc submit`)") from None


def check_batch(new: Config, provenance: dict[str, str]) -> None:
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
                      "do not divide it", where=where_set("resources.nodes", provenance),
                      key="train.micro_batch_size" if micros else "resources.nodes",
                      fix="; or ".join(options) or f"no world size divides {gbs}")


def split_nodes(text: str) -> list[str]:
    """`n1,n2,gpu-[01,03]`: commas separate nodes, except inside a hostlist range's brackets."""
    return [part.strip() for part in re.split(r",(?![^\[]*\])", text) if part.strip()]


def exclude_override(old: Config, exclude: str) -> list[str]:
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
