"""The evaluation array's entry point: one call per shard of the (task, seed, episode) grid.

Each shard runs its episodes with every policy of the evaluation, the same episodes for each:
- "trained": the recipe's model (model.name) from exported weights (eval.weights, or the export of the checkpoint it
  names, else the run's own export/), loaded once per shard;
- the reference rows eval.reference_policies: the suite's scripted expert (where it has one) and random.
One JSONL file per (policy, shard) under eval/shards/<policy>/, written atomically (see embodyhpc.eval.rollout),
rollout videos under eval/videos/. eval.envs_per_shard > 1 runs that many episodes at once, each env in its own
worker process, the trained policy acting on all of them in one batch (embodyhpc.eval.vector);
eval.gpus_per_task > 0 puts the trained policy on the shard's GPU in bf16. A recipe that trains no policy
(data.format: synthetic) is evaluated with the reference rows only.

A failed shard is retried once: under Slurm it asks for its own array element to be requeued (the report then
waits for it, as the report depends on the whole array); a second failure stays failed and the report names the
missing episodes.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from embodyhpc.checkpoint.integrity import EXPORT_JSON
from embodyhpc.config.schema import Config
from embodyhpc.eval.shards import plan_shards
from embodyhpc.evaluate import checkpoint_export_dir, evaluated_checkpoint
from embodyhpc.rundir import EXPORT_DIR, VIDEOS_DIR, shard_file
from embodyhpc.validation import load_resolved

TRAINED = "trained"
SHARD_STARTED_FIELD = "shard_started_at"
"""Each record's extra field: when its shard started with its policy (s since the epoch; the report's start time)."""
SHARD_RETRIES = 1


def weights_dir(config: Config, run_dir: Path) -> Path | None:
    """The exported weights this evaluation runs: eval.weights (for a run's checkpoints/step-N, where the export job
    wrote it: the run's exports/step-N, or this evaluation's own export/), else the run's export (None: nothing
    trained)."""
    if config.eval.weights:
        checkpoint = evaluated_checkpoint(config.eval)
        if checkpoint is None:
            return Path(config.eval.weights)
        own = Path(run_dir) / EXPORT_DIR  # where the export job put it when the run's exports/ could not be used
        return own if (own / EXPORT_JSON).is_file() else checkpoint_export_dir(checkpoint)
    if config.data.format == "synthetic":
        return None
    return Path(run_dir) / EXPORT_DIR


def policy_names(config: Config) -> list[str]:
    """Rows of the report, in order; the trained row only when there are weights to evaluate."""
    names = [TRAINED] if weights_dir(config, Path(".")) is not None else []
    return names + list(config.eval.reference_policies)


def planned_tasks(config: Config) -> list[str]:
    """The recipe's tasks as the suite expands them (MetaWorld: "MT10" -> ten names): what shards are planned on."""
    from embodyhpc.eval.suites import make_suite

    with make_suite(config.eval.suite, list(config.eval.tasks), **config.eval.suite_options) as suite:
        return list(suite.tasks)


def plan(config: Config):
    ev = config.eval
    return plan_shards(planned_tasks(config), list(ev.seeds), ev.episodes_per_task, ev.shards)


def eval_shard_task(run_dir: str, shard: int) -> dict:
    try:
        return _run(Path(run_dir), shard)
    except Exception:
        _retry_once(shard)
        raise


def _run(run: Path, shard: int) -> dict[str, Any]:
    from embodyhpc.eval.references import make_reference_policies, make_reference_policy
    from embodyhpc.eval.rollout import run_shard
    from embodyhpc.eval.vector import PerEnvPolicies, SuiteSpec, run_shard_vector

    config = load_resolved(run)
    ev = config.eval
    episodes = plan(config)[shard]
    policies: dict[str, Any] = {}
    cameras: list[str] = []
    image_size = ev.image_size
    weights = weights_dir(config, run)
    step = None
    if weights is not None:
        from embodyhpc.eval.trained import load_trained_policy
        from embodyhpc.rundir import read_policy_io

        io = read_policy_io(weights)
        cameras, image_size = io.get("cameras", []), io.get("image_size") or image_size  # None: state only
        workers = ev.envs_per_shard if ev.envs_per_shard > 1 else 0  # env workers take a core each
        policies[TRAINED] = load_trained_policy(weights, execute_steps=ev.execute_steps,
                                                denoise_steps=ev.denoise_steps,
                                                threads=max(1, ev.cpus_per_task - workers), gpus=ev.gpus_per_task)
        step = policies[TRAINED].step
    # the trained policy sees the cameras it was trained on; reference rows read state only (no rendering but
    # their videos), which makes them ~10x cheaper
    suites = {TRAINED: (cameras, image_size), "reference": ((), image_size)}
    specs = {row: SuiteSpec.of(ev.suite, list(ev.tasks), cameras=c, image_size=size, **ev.suite_options)
             for row, (c, size) in suites.items()}
    state_suite = specs["reference"].make()
    suite = specs[TRAINED].make() if ev.envs_per_shard == 1 and TRAINED in policies else None
    try:
        policies.update(make_reference_policies(ev.reference_policies, state_suite))
        summaries = {}
        for name, policy in policies.items():
            row = TRAINED if name == TRAINED else "reference"
            common = dict(policy_name=name, video_dir=run / VIDEOS_DIR, videos_per_task=ev.videos_per_task,
                          max_steps=ev.max_steps or None,
                          extra={"shard": shard, "checkpoint_step": step, "host": socket.gethostname(),
                                 SHARD_STARTED_FIELD: time.time()})
            if ev.envs_per_shard > 1:
                batch = policy if name == TRAINED else PerEnvPolicies(
                    lambda name=name: make_reference_policy(name, state_suite), ev.envs_per_shard)
                summary = run_shard_vector(specs[row], episodes, batch, shard_file(run, name, shard),
                                           num_envs=ev.envs_per_shard, **common)
            else:
                summary = run_shard(suite if name == TRAINED else state_suite, episodes, policy,
                                    shard_file(run, name, shard), **common)
            summaries[name] = summary.to_dict()
            print(f"shard {shard}: {name}: {summary.successes}/{summary.episodes} successes "
                  f"({summary.episodes_per_s:.2f} episodes/s, {summary.num_envs} env(s) at once)", flush=True)
    finally:
        if suite is not None:
            suite.close()
        state_suite.close()
    return {"shard": shard, "episodes": len(episodes), "policies": summaries}


def _retry_once(shard: int) -> None:
    """Under Slurm, requeue this array element once (SLURM_RESTART_COUNT counts the restarts)."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    if not job or task is None or int(os.environ.get("SLURM_RESTART_COUNT", "0")) >= SHARD_RETRIES:
        return
    from embodyhpc.slurm.commands import requeue

    try:
        requeue(f"{job}_{task}")
        print(f"shard {shard} failed: requeued once ({job}_{task})", file=sys.stderr, flush=True)
    except Exception as exc:  # the failure itself is what matters; the report will name the missing shard
        print(f"shard {shard} failed and could not be requeued: {exc}", file=sys.stderr, flush=True)


def shard_records(run: Path, policy: str, shard: int) -> list[dict] | None:
    path = shard_file(run, policy, shard)
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
