"""GR00T against a training dataset, at validate (the spec's check_dataset): what its collate would refuse in a
DataLoader worker, refused before the job is submitted.

- at least one camera, and an instruction budget (model.max_token_len after every camera's image tokens;
  build.max_text_tokens) of at least 8 tokens; a longer task is cut (a warning names the longest);
- a state no wider than the state encoder reads (64 dims), an action no wider than model.action_dim;
- a mixture's entry (validation/mixture_checks.py EntryFacts): its embodiment is an id 0..31 or one of GR00T's
  names (batching.py embodiment_id), refused here rather than at the first batch.
Imports torch (the builders do): it runs only when the dataset is on this machine.
"""

from __future__ import annotations

import math
from typing import Any

from embodyhpc.errors import ConfigError


def check_dataset(model_cfg: Any, facts: Any) -> list[str]:
    from embodyhpc.models.groot.build import build_groot_tokenizer, max_text_tokens
    from embodyhpc.models.groot.shapes import shape_for

    warnings: list[str] = []
    if getattr(facts, "embodiment", None) is not None:
        from embodyhpc.models.groot import NUM_EMBODIMENTS
        from embodyhpc.models.groot.batching import embodiment_id

        embodiment_id(facts.embodiment, NUM_EMBODIMENTS, entry=getattr(facts, "entry", ""))
    cameras = len(facts.cameras)
    if cameras == 0:
        raise ConfigError(f"the dataset at {facts.root} has no camera (observation.images.*): GR00T reads at least "
                          "one", key="data.root", fix="train on a dataset with camera features")
    budget = max_text_tokens(model_cfg, cameras)
    max_state = shape_for(model_cfg.size).head.max_state_dim
    state_dims = math.prod(facts.features.get(model_cfg.state_key, ())) or 0
    if state_dims > max_state:
        raise ConfigError(f"the state {model_cfg.state_key!r} has {state_dims} dims, GR00T's state encoder reads at "
                          f"most {max_state}", key="model.state_key", fix="name a shorter state feature")
    action_dims = math.prod(facts.features.get("action", ())) or 0
    if action_dims > model_cfg.action_dim:
        raise ConfigError(f"the dataset has {action_dims} action dims, more than model.action_dim="
                          f"{model_cfg.action_dim}", key="model.action_dim", fix=f"set model.action_dim={action_dims}")
    if facts.tasks:
        tokenizer = build_groot_tokenizer(model_cfg)
        longest = max(facts.tasks, key=lambda task: len(tokenizer.encode(task)))
        length = len(tokenizer.encode(longest))
        if length > budget:
            warnings.append(f"model.max_token_len={model_cfg.max_token_len}: the longest task ({longest[:60]!r}) is "
                            f"{length} tokens and {budget} fit after the images, so its end is cut in training; "
                            f"model.max_token_len={model_cfg.max_token_len + length - budget} keeps it whole")
    return warnings
