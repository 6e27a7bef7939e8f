"""The recipe's `eval:` section (split from schema.py; `embodyhpc.config.schema` re-exports it): what evaluation
runs, on which simulator suite and weights, and how its episodes are spread over the array's shards."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from embodyhpc.config import checks
from embodyhpc.errors import ConfigError

MAX_EVAL_SEED = 2**31 - 1
WEIGHTS_KINDS = ("ema", "raw")
"""eval.weights_kind's values: the moving average of the weights (train.ema_decay), or the optimizer's own."""


@dataclass(frozen=True)
class EvalConfig:
    enabled: bool = True
    """Chain an evaluation array job and a report job after training."""
    suite: str = "metaworld"
    """Simulator suite: metaworld, pusht, libero, or one a site registers (embodyhpc.eval.suites)."""
    tasks: list[str] = field(default_factory=lambda: ["reach-v3"])
    """Tasks of the suite (MetaWorld: names, or MT10 / MT50; LIBERO: libero_spatial, libero_goal/3, ...)."""
    suite_options: dict[str, Any] = field(default_factory=dict)
    """Options of the suite's own (LIBERO: convention lerobot|openpi, render_quality exact|fast, video_size)."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Environment seeds; every task runs every seed."""
    episodes_per_task: int = 10
    """Episodes per (task, seed)."""
    shards: int = 4
    """Array elements the (task, seed, episode) grid is split into."""
    array_parallelism: int = 8
    """At most this many shards run at once (sbatch --array=...%N)."""
    cpus_per_task: int = 1
    gpus_per_task: int = 0
    """GPUs per shard, requested in the site's style (site.gpu_request); the trained policy then runs on the
    shard's GPU in bf16 (0: on the CPU in fp32)."""
    envs_per_shard: int = 1
    """Episodes a shard runs at once, each env stepping in its own worker process, the policy acting on all
    their observations in one batch (embodyhpc.eval.vector); 1: one episode after another in the shard's process."""
    mem: str = "4G"
    time: str = "00:30:00"
    """Time limit per shard."""
    every_k_checkpoints: int = 0
    """Also evaluate every k-th periodic checkpoint while training runs (steps that are multiples of k x
    checkpoint.every_steps, before train.steps), each as its own export -> eval -> report chain under
    <run>/evals/step-N that never blocks training (embodyhpc/launch/checkpoint_eval.py); 0 = only after training.
    Policy training only (not data.format: synthetic)."""
    weights: str | None = None
    """What to evaluate: an export folder (model.safetensors, config.yaml, export.json), or a run's
    checkpoints/step-N folder, which an export job writes to <run>/exports/step-N first; default: the run's own
    export. `embodyhpc eval --ckpt` and evaluations while training set it."""
    weights_kind: str | None = None
    """Which weights of a checkpoint the export (and so every evaluation, checkpoint evaluation, LeRobot export and
    logged model made from it) holds: ema (the moving average of train.ema_decay) or raw (the optimizer's);
    null = ema when the checkpoint has one, else raw. ema for a checkpoint without one is refused. (Not
    `eval.weights`: that key names the folder to evaluate.)"""
    reference_policies: list[str] = field(default_factory=lambda: ["expert", "random"])
    """Reference rows of every report, run on the same episodes: expert (where the suite has one), random, replay
    (a dataset's actions played back open-loop, a check of the env conventions: needs
    eval.suite_options.replay_dataset, a LeRobot dataset; libero takes it)."""
    execute_steps: int = 5
    """Actions executed from each predicted chunk before the policy observes again (receding horizon)."""
    denoise_steps: int = 10
    """Euler steps of the flow-matching sampler per chunk."""
    max_steps: int = 0
    """Step limit per episode; 0 = the suite's own limit per task."""
    videos_per_task: int = 1
    """Rollout videos (mp4) recorded for the first episodes of each (task, seed), per policy."""
    image_size: int = 64
    """Rendered camera size for policies that did not record one (a trained policy renders what it trained on)."""

    def __post_init__(self) -> None:
        # the suite, its options and tasks, the reference policies, then the episodes those tasks make for the
        # shards: validation/registries.py's
        if not self.tasks:
            raise ConfigError("needs at least one task", key="eval.tasks")
        if not self.seeds:
            raise ConfigError("needs at least one seed", key="eval.seeds")
        for seed in self.seeds:  # simulators take 32-bit seeds (MetaWorld adds episode // 50 to it)
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_EVAL_SEED:
                raise ConfigError(f"{seed!r} is not a seed from 0 to {MAX_EVAL_SEED}", key="eval.seeds",
                                  fix="use seeds such as [0, 1, 2]")
        if len(set(self.seeds)) != len(self.seeds):
            twice = next(seed for seed in self.seeds if self.seeds.count(seed) > 1)
            raise ConfigError(f"seed {twice} is listed twice: its episodes would count twice", key="eval.seeds",
                              fix="list each seed once")
        for key in ("episodes_per_task", "shards", "array_parallelism", "cpus_per_task", "envs_per_shard"):
            checks.positive(f"eval.{key}", getattr(self, key))
        checks.positive("eval.gpus_per_task", self.gpus_per_task, allow_zero=True)
        if self.envs_per_shard > self.cpus_per_task:  # each env worker steps on a core of its own
            raise ConfigError(f"{self.envs_per_shard} envs per shard need as many cores, the shard has "
                              f"{self.cpus_per_task}", key="eval.envs_per_shard", related=("eval.cpus_per_task",),
                              fix=f"set eval.cpus_per_task={self.envs_per_shard + 1} (a core per env and one for "
                                  "the policy) or fewer envs")
        checks.positive("eval.every_k_checkpoints", self.every_k_checkpoints, allow_zero=True)
        if self.weights_kind is not None:
            checks.choice("eval.weights_kind", self.weights_kind, WEIGHTS_KINDS)
        for key in ("execute_steps", "denoise_steps", "image_size"):
            checks.positive(f"eval.{key}", getattr(self, key))
        for key in ("max_steps", "videos_per_task"):
            checks.positive(f"eval.{key}", getattr(self, key), allow_zero=True)
        if "replay" in self.reference_policies and not self.suite_options.get("replay_dataset"):
            raise ConfigError("the replay row plays a dataset's actions back and none is given",
                              key="eval.reference_policies", related=("eval.suite_options.replay_dataset",),
                              fix="set eval.suite_options.replay_dataset=/path/to/lerobot_dataset, or drop replay")
        checks.slurm_mem("eval.mem", self.mem)
        checks.slurm_time_minutes("eval.time", self.time)
