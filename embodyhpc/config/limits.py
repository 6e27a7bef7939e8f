"""Numbers that parse but cannot be meant, and numbers legal but large enough to be a slip.

Checked when a recipe is resolved (validate, render, submit, resume, eval --ckpt), not when a job reads its own
resolved.yaml. A value past its bound is one line naming the key and the bound: past it a job would fail late (numpy
refuses a seed past 2**32 - 1, sbatch a --signal past 65535 s, an array past MaxArraySize) or allocate absurdly
(`model.action_horizon=10**9`). Bounds sit orders of magnitude past real use: pi0.5 predicts 50 actions, GR00T 16;
the largest clusters have tens of thousands of nodes. Below them, values that are legal but rare enough to be a typo
(100,000 nodes, a million evaluation episodes, a 30-day time limit) are warnings that name the number.
"""

from __future__ import annotations

from typing import Any

from embodyhpc.config.checks import slurm_time_minutes
from embodyhpc.errors import ConfigError

SEED_MAX = 2**32 - 1
"""numpy's legacy seeding (np.random.seed, the DataLoader workers) takes 0 .. 2**32 - 1."""
BILLION = 1_000_000_000
MAX_ARRAY_ELEMENTS = 4_000_001
"""Slurm's ceiling for MaxArraySize (array indices 0 .. 4,000,000)."""
DEFAULT_MAX_ARRAY_SIZE = 1001
"""slurm.conf's default MaxArraySize: sbatch refuses a larger array unless the cluster raised it."""

# key: (the largest value that can be meant, why)
MAXIMA: dict[str, tuple[int, str]] = {
    "resources.nodes": (1_000_000, "more nodes than any cluster has"),
    "resources.gpus_per_node": (64, "more GPUs than any node holds"),
    "resources.tasks_per_node": (1024, "more processes per node than any node runs"),
    "resources.cpus_per_task": (4096, "more cores than any node has"),
    "resources.signal_delay_s": (65535, "longer than sbatch --signal allows (65535 s)"),
    "resources.max_requeues": (10_000, "more requeues than any time limit needs"),
    "data.num_workers": (1024, "more DataLoader workers than any node runs"),
    "data.prefetch_factor": (1024, "more batches per worker than memory holds"),
    "staging.copy_workers": (1024, "more copy threads than any node runs"),
    "model.action_horizon": (10_000, "more actions per chunk than any policy predicts (pi0.5: 50, GR00T: 16)"),
    "model.action_dim": (10_000, "a larger action vector than any robot has"),
    "model.state_dim": (10_000, "a larger state vector than any robot has"),
    "model.max_token_len": (1_048_576, "more tokens per sample than attention can hold"),
    "parallelism.ac_every_k": (10_000, "more blocks than any model has"),
    "train.steps": (BILLION, "more optimizer steps than any run takes"),
    "train.warmup_steps": (BILLION, "more optimizer steps than any run takes"),
    "train.log_every": (BILLION, "more optimizer steps than any run takes"),
    "train.global_batch_size": (16_777_216, "more samples per step than any run uses"),
    "train.micro_batch_size": (1_048_576, "more samples per rank than any device holds"),
    "checkpoint.every_steps": (BILLION, "more optimizer steps than any run takes"),
    "checkpoint.keep_latest_k": (10_000, "more checkpoints than any disk keeps"),
    "eval.episodes_per_task": (10_000_000, "more episodes than any evaluation runs"),
    "eval.shards": (MAX_ARRAY_ELEMENTS, "more array elements than Slurm allows (MaxArraySize's ceiling 4000001)"),
    "eval.array_parallelism": (MAX_ARRAY_ELEMENTS, "more array elements than Slurm allows"),
    "eval.cpus_per_task": (4096, "more cores than any node has"),
    "eval.gpus_per_task": (64, "more GPUs than any node holds"),
    "eval.envs_per_shard": (1024, "more env processes than any node runs"),
    "eval.every_k_checkpoints": (BILLION, "more checkpoints than any run writes"),
    "eval.execute_steps": (10_000, "more actions per chunk than any policy predicts"),
    "eval.denoise_steps": (10_000, "more sampler steps than any policy takes"),
    "eval.max_steps": (100_000_000, "longer episodes than any simulator runs"),
    "eval.videos_per_task": (10_000, "more videos than any report shows"),
    "eval.image_size": (8192, "larger frames than any camera renders"),
}

# key: (the value above which it is worth a warning, what to check)
LARGE: dict[str, tuple[int, str]] = {
    "resources.nodes": (1024, "more nodes than most clusters have"),
    "resources.gpus_per_node": (16, "more GPUs than today's nodes hold (8 on most)"),
    "resources.max_requeues": (100, "each requeue waits in the queue again"),
    "train.steps": (10_000_000, "weeks of training even at 10 steps/s"),
    "checkpoint.keep_latest_k": (100, "every kept checkpoint holds the model and optimizer state on disk"),
    "eval.shards": (DEFAULT_MAX_ARRAY_SIZE, "sbatch refuses arrays above the cluster's MaxArraySize (default 1001; "
                                            "`scontrol show config | grep MaxArraySize`)"),
}
EPISODES_LARGE = 100_000
TIME_LARGE_MIN = 7 * 24 * 60
LR_LARGE = 1.0


def _value(config: Any, key: str) -> Any:
    value = config
    for part in key.split("."):
        value = getattr(value, part)
    return value


def check(config: Any) -> None:
    """Refuse a value no run can mean, naming the key (the loader adds the layer that set it)."""
    for key, (limit, why) in MAXIMA.items():
        value = _value(config, key)
        if value is not None and value > limit:
            raise ConfigError(f"{value} is {why} (at most {limit})", key=key, fix=f"set {key} to at most {limit}")
    seed = config.train.seed  # eval.seeds: EvalConfig holds them to what simulators take
    if not 0 <= seed <= SEED_MAX:
        raise ConfigError(f"{seed} is outside the seeds numpy takes (0 .. {SEED_MAX})", key="train.seed",
                          fix=f"use a seed in 0 .. {SEED_MAX}")
    episodes = len(config.eval.tasks) * len(config.eval.seeds) * config.eval.episodes_per_task
    if episodes > 10 * MAXIMA["eval.episodes_per_task"][0]:
        raise ConfigError(f"{episodes} evaluation episodes (tasks x seeds x episodes_per_task) is more than any "
                          "evaluation runs", key="eval.episodes_per_task", related=("eval.tasks", "eval.seeds"),
                          fix="lower eval.episodes_per_task or the number of seeds")
    train, model, ev = config.train, config.model, config.eval
    policy = config.data.format != "synthetic"  # the synthetic stand-in has no schedule and no policy
    if policy and train.warmup_steps >= train.steps:
        raise ConfigError(f"warmup_steps={train.warmup_steps} is not below steps={train.steps}: the learning rate "
                          "would never reach train.lr nor decay (training refuses it at step 0)",
                          key="train.warmup_steps", related=("train.steps",),
                          fix=f"set train.warmup_steps={max(train.steps // 10, 0)} (or raise train.steps)")
    if ev.enabled and (policy or ev.weights) and ev.execute_steps > model.action_horizon:
        raise ConfigError(f"execute_steps={ev.execute_steps} is more than the {model.action_horizon} actions a chunk "
                          "holds (model.action_horizon): every evaluation shard would fail", key="eval.execute_steps",
                          related=("model.action_horizon",), fix=f"set eval.execute_steps={model.action_horizon} "
                                                                 "or fewer")


def warnings(config: Any) -> list[str]:
    """Values that are legal but large enough to be a slip: one line each, naming the number."""
    found = []
    for key, (threshold, why) in LARGE.items():
        value = _value(config, key)
        if value is not None and value > threshold:
            found.append(f"{key}={value}: {why}; check that {value} is meant")
    ev = config.eval
    episodes = len(ev.tasks) * len(ev.seeds) * ev.episodes_per_task
    if ev.enabled and episodes > EPISODES_LARGE:
        found.append(f"eval: {episodes} episodes per policy ({len(ev.tasks)} tasks x {len(ev.seeds)} seeds x "
                     f"{ev.episodes_per_task} episodes_per_task); check that {episodes} is meant")
    for key, text in (("resources.time", config.resources.time), ("eval.time", ev.time)):
        minutes = slurm_time_minutes(key, text)
        if minutes > TIME_LARGE_MIN:
            found.append(f"{key}={text}: {minutes} minutes ({minutes / 1440:.1f} days) is longer than most "
                         "partitions allow (Slurm then keeps the job pending, reason PartitionTimeLimit; "
                         "`scontrol show partition` shows MaxTime)")
    if config.train.lr > LR_LARGE:
        found.append(f"train.lr={config.train.lr}: above {LR_LARGE:g}, where AdamW diverges (fine-tuning uses "
                     "1e-5 .. 1e-4); check that it is meant")
    return found

