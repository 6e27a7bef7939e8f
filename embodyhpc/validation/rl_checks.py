"""The checks of an RL recipe (rl.enabled) that involve other sections than `rl:` (each key's own check is the
schema's, embodyhpc/config/rl_schema.py). Where RL trains, eval.suite and eval.tasks, is checked against the suites
by registries.check_eval for every recipe."""

from __future__ import annotations

from embodyhpc.config.schema import Config
from embodyhpc.errors import ConfigError


def check_rl(config: Config) -> None:
    """Raise the first one-line ConfigError (naming its key; the caller names the layer) of an RL recipe."""
    rl = config.rl
    if not rl.enabled:
        return
    if not config.model.init_weights:
        raise ConfigError("RL fine-tunes a policy and none is given: it would start from random weights, whose "
                          "episodes never succeed (no reward to learn from)", key="model.init_weights",
                          related=("rl.enabled",),
                          fix="set model.init_weights=/path/to/export (a supervised policy: an embodyhpc export "
                              "or published pi0.5 weights)")
    if config.data.datasets:
        raise ConfigError("RL reads one dataset, for the statistics that normalise the policy's states, and this "
                          "recipe names a mixture (data.datasets)", key="data.datasets", related=("rl.enabled",),
                          fix="set data.root to the mixture's evaluation entry (the statistics its export holds) "
                              "and data.datasets=null")
    both = sorted(set(rl.train_seeds) & set(config.eval.seeds))
    if both:
        raise ConfigError(f"seed(s) {', '.join(map(str, both))} in both rl.train_seeds and eval.seeds: the "
                          "evaluation would score episodes RL trained on, not held-out ones", key="rl.train_seeds",
                          related=("eval.seeds",),
                          fix=f"use RL seeds that eval.seeds does not list, e.g. rl.train_seeds="
                              f"[{max(config.eval.seeds) + 1}]")
    horizon = config.model.action_horizon
    if rl.execute_steps > horizon:
        raise ConfigError(f"execute_steps={rl.execute_steps} is more than the {horizon} actions a chunk holds "
                          "(model.action_horizon)", key="rl.execute_steps", related=("model.action_horizon",),
                          fix=f"set rl.execute_steps={horizon} or fewer")
    per_step = rl.micro_batch_size * rl.actor_ranks
    batch = config.train.global_batch_size
    if rl.async_ and batch % per_step:  # synchronous: a version is a round of episodes, whatever its samples
        raise ConfigError(f"train.global_batch_size={batch} (chunk samples per actor step, rl.async) is not a "
                          f"multiple of rl.micro_batch_size={rl.micro_batch_size} x rl.actor_ranks={rl.actor_ranks}",
                          key="train.global_batch_size", related=("rl.micro_batch_size", "rl.actor_ranks"),
                          fix=f"use a multiple of {per_step} (or another rl.micro_batch_size)")
    if config.eval.every_k_checkpoints:
        raise ConfigError("evaluations of checkpoints while the policy trains are started by the training job, "
                          "and an RL run has none: the RL run is evaluated once it ends",
                          key="eval.every_k_checkpoints", related=("rl.enabled",),
                          fix="set eval.every_k_checkpoints=0 (or `embodyhpc eval --ckpt RUN` a checkpoint)")
