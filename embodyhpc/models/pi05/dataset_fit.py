"""pi0.5 against a training dataset, at validate (the spec's check_dataset): what its collate would refuse in a
DataLoader worker, refused before the job is submitted.

- at least one camera, and a prompt budget (model.max_token_len after every camera's patches and the action chunk;
  build.max_prompt_tokens) of at least 8 tokens;
- with model.state_input=prompt, the prompt without its instruction ("Task: , State: <bins>;\\nAction: ", every
  state dimension written as the widest bin number, 255) fits the budget, or every sample would fail; a task whose
  prompt does not fit is cut at its end (a warning names the longest). A mixture's entry (facts.state_padded_to,
  validation/mixture_checks.py) writes its state zero-padded to model.state_dim: those are the bins counted;
- with model.state_input=expert, the dataset's state is no wider than model.state_dim (the projection's input);
- more action dimensions than model.action_dim are trimmed (a warning, as in training).
Imports torch (the tokenizer module does): it runs only when the dataset is on this machine.
"""

from __future__ import annotations

import math
from typing import Any

from embodyhpc.errors import ConfigError

_WIDEST_BIN = 1.0  # a state at its upper bound: every dimension is written as bin 255, the widest number


def check_dataset(model_cfg: Any, facts: Any) -> list[str]:
    import torch

    from embodyhpc.models.pi05.build import build_pi05_tokenizer, max_prompt_tokens
    from embodyhpc.models.tokenizer import encode_prompt

    warnings: list[str] = []
    cameras = len(facts.cameras)
    if cameras == 0:
        raise ConfigError(f"the dataset at {facts.root} has no camera (observation.images.*): pi0.5 reads at least "
                          "one", key="data.root", fix="train on a dataset with camera features")
    budget = max_prompt_tokens(model_cfg, cameras)
    state_dims = math.prod(facts.features.get(model_cfg.state_key, ())) or 0
    padded = max(state_dims, getattr(facts, "state_padded_to", None) or 0)  # a mixture's: batching.py _pad_state
    if model_cfg.state_input == "prompt":
        tokenizer = build_pi05_tokenizer(model_cfg)
        state = torch.full((padded,), _WIDEST_BIN)

        def prompt_tokens(task: str) -> int:
            return len(encode_prompt(tokenizer, task, state, max_tokens=1 << 30))

        fixed = prompt_tokens("")
        if fixed > budget:
            need = model_cfg.max_token_len + fixed - budget
            mixed = "" if padded == state_dims else \
                f", its {state_dims} dims zero-padded to model.state_dim={padded} as every dataset's of a mixture"
            raise ConfigError(f"the prompt without its instruction takes up to {fixed} tokens (the {padded}-dim "
                              f"state {model_cfg.state_key!r} written into it{mixed}, model.state_input=prompt), but "
                              f"max_token_len={model_cfg.max_token_len} leaves {budget} after {cameras} camera(s) and "
                              f"{model_cfg.action_horizon} actions: every sample would fail",
                              key="model.max_token_len", related=("model.state_input",),
                              fix=f"set model.max_token_len={need} or more (or model.state_input=expert"
                                  + (", or a smaller model.state_dim)" if mixed else ")"))
        if facts.tasks:
            longest = max(facts.tasks, key=prompt_tokens)
            length = prompt_tokens(longest)
            if length > budget:
                warnings.append(f"model.max_token_len={model_cfg.max_token_len}: the longest task ({longest[:60]!r}) "
                                f"makes a {length}-token prompt and {budget} fit, so its end is cut in training; "
                                f"model.max_token_len={model_cfg.max_token_len + length - budget} keeps it whole")
    elif state_dims > model_cfg.state_dim:
        raise ConfigError(f"the dataset's state {model_cfg.state_key!r} has {state_dims} dims, the model reads "
                          f"{model_cfg.state_dim} (model.state_input=expert)", key="model.state_dim",
                          related=("model.state_key",), fix=f"set model.state_dim={state_dims}")
    action_dims = math.prod(facts.features.get("action", ())) or 0
    if action_dims > model_cfg.action_dim:
        warnings.append(f"model.action_dim={model_cfg.action_dim}: the dataset has {action_dims} action dims, dims "
                        f"{model_cfg.action_dim}.. are dropped and never learned (set model.action_dim={action_dims} "
                        "to keep them)")
    return warnings
