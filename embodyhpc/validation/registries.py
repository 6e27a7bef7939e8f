"""The checks of a recipe that need the registries: the model family (its spec: name, options, sizes, keys, own
check) and the evaluation's suite, its options and tasks, and the reference policies (then the episodes those
tasks make, against eval.shards: an unknown task is named as such, not as too few episodes). Nothing here imports
torch or a simulator: specs and suites are read, not built (model.lora's targets aside: lora_checks.py)."""

from __future__ import annotations

import difflib

from embodyhpc.config import checks
from embodyhpc.config.schema import Config, EvalConfig
from embodyhpc.errors import ConfigError
from embodyhpc.validation.lora_checks import check_lora
from embodyhpc.validation.rl_checks import check_rl


def validate(config: Config) -> None:
    """Raise the first one-line ConfigError (naming its key; the caller names the layer) of the model section
    against its family's spec, then of the eval section against the suite and reference-policy registries, then of
    an RL recipe across its sections (rl_checks), then model.lora against precision and the model's layers
    (lora_checks: the one check that imports torch, and only for a recipe with model.lora)."""
    from embodyhpc.models.spec import check_model_config

    check_model_config(config.model)
    check_eval(config.eval)
    check_rl(config)
    check_lora(config)


def check_eval(ev: EvalConfig) -> None:
    from embodyhpc.eval.references import reference_policy_names
    from embodyhpc.eval.suites import available_suites, suite_option_names
    from embodyhpc.eval.task_names import unknown_task

    checks.choice("eval.suite", ev.suite, tuple(available_suites()))
    allowed = suite_option_names(ev.suite) if ev.suite_options else []
    for key in ev.suite_options:
        if key not in allowed:
            raise ConfigError(f"the {ev.suite} suite has no option {key!r}", key=f"eval.suite_options.{key}",
                              fix=f"use one of: {', '.join(allowed) or 'none'}")
    unknown = unknown_task(ev.suite, list(ev.tasks))
    if unknown is not None:
        task, accepted = unknown
        close = difflib.get_close_matches(task, accepted, n=1)
        raise ConfigError(f"{task!r} is not a task of the {ev.suite} suite", key="eval.tasks",
                          fix=f"did you mean {close[0]!r}?" if close else f"use one of: {', '.join(accepted)}")
    for name in ev.reference_policies:
        checks.choice("eval.reference_policies", name, tuple(reference_policy_names()))
    num_episodes = len(ev.tasks) * len(ev.seeds) * ev.episodes_per_task  # once the tasks are known to be tasks
    if ev.shards > num_episodes:
        raise ConfigError(f"{ev.shards} shards for {num_episodes} episodes would leave shards empty", key="eval.shards",
                          related=("eval.tasks", "eval.seeds", "eval.episodes_per_task"),
                          fix=f"set eval.shards={num_episodes} or fewer")
