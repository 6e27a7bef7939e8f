"""The one validation step of a recipe, above the packages it asks: config (the schema, pure data and the checks
that need nothing else), models (a family's spec: its name, options, sizes and keys), eval (suites, their tasks
and options, reference policies) and data (a dataset's metadata against the recipe).

Every command that loads a recipe loads it here: submit, dry-run, validate, resume, `eval --ckpt`, `recipes show`,
jobs reading their run's resolved.yaml, the tests' helpers.

    load       load_recipe / load_unresolved / load_config_file / load_resolved: config/load.py, then validate()
    registries validate(config): the model section through its family's spec, the eval section through the suites
    rl_checks  check_rl (called by validate): an RL recipe across its sections (a starting policy, held-out seeds,
               the chunk against the model, the actor's batch)
    paths      check_paths: paths a job will read, at validate, render and submit (warnings for unmounted ones)
    data_checks check_recipe_data: the recipe against its dataset's metadata

Nothing here imports torch at load (validate reads specs and suites, never builds them).
"""

from __future__ import annotations

from embodyhpc.validation.load import load_config_file, load_recipe, load_resolved, load_unresolved
from embodyhpc.validation.registries import validate

__all__ = ["load_config_file", "load_recipe", "load_resolved", "load_unresolved", "validate"]
