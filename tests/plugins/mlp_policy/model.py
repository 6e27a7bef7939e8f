"""The MLP policy: network, batch builder, sample count and the evaluation runner of SPEC."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from embodyhpc.models.init import Constant, Normal, Rule, init_parameters


def options_of(model_cfg: Any):
    from tests.plugins.mlp_policy import SPEC

    return SPEC.parse_options(model_cfg.options)


@dataclass
class MlpBatch:
    state: torch.Tensor  # [B, state_width]
    actions: torch.Tensor  # [B, horizon, action_dim], zero-padded dims
    valid: torch.Tensor  # [B, horizon, action_dim] float: 1 where a real, non-padded action value is

    def to(self, device: torch.device | str) -> MlpBatch:
        return MlpBatch(self.state.to(device), self.actions.to(device), self.valid.to(device))


@dataclass
class Output:
    loss: torch.Tensor


class MlpPolicy(nn.Module):
    def __init__(self, *, state_width: int, hidden_width: int, num_blocks: int, action_horizon: int,
                 action_dim: int) -> None:
        super().__init__()
        self.action_horizon, self.action_dim, self.state_width = action_horizon, action_dim, state_width
        self.stem = nn.Linear(state_width, hidden_width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden_width, hidden_width), nn.GELU())
                                    for _ in range(num_blocks))
        self.head = nn.Linear(hidden_width, action_horizon * action_dim)
        self.init_weights()

    def fsdp_units(self) -> list[nn.Module]:
        return list(self.blocks)

    def init_rules(self, fqn: str, module: nn.Module) -> dict[str, Rule]:
        if isinstance(module, nn.Linear):
            return {"weight": Normal(0.05), "bias": Constant(0.0)}
        return {}

    def init_weights(self, seed: int | None = None) -> None:
        if any(p.is_meta for p in self.parameters()):
            return
        init_parameters(self, self.init_rules, seed)

    def predict(self, state: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.stem(state))
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(hidden).unflatten(-1, (self.action_horizon, self.action_dim))

    def forward(self, batch: MlpBatch) -> Output:
        error = (self.predict(batch.state) - batch.actions) ** 2 * batch.valid
        return Output(error.sum() / batch.valid.sum().clamp(min=1.0))


def build(model_cfg: Any, precision_cfg: Any = None) -> MlpPolicy:
    options = options_of(model_cfg)
    return MlpPolicy(state_width=options.state_width, hidden_width=options.hidden_width,
                     num_blocks=options.num_blocks, action_horizon=model_cfg.action_horizon,
                     action_dim=model_cfg.action_dim)


def _pad(vector: torch.Tensor, width: int, what: str) -> torch.Tensor:
    if vector.shape[-1] > width:
        raise ValueError(f"the {what} has {vector.shape[-1]} values, more than {width}")
    return torch.nn.functional.pad(vector, (0, width - vector.shape[-1]))


class MlpCollate:
    """Dataset items -> MlpBatch: the state (newest frame) and the action chunk; images and text are not read."""

    def __init__(self, model_cfg: Any, tokenizer: Any, normalizer: Any = None) -> None:
        self.model_cfg, self.normalizer = model_cfg, normalizer
        self.state_width = options_of(model_cfg).state_width

    def __call__(self, items: Sequence[Mapping[str, Any]]) -> MlpBatch:
        states, actions, valid = [], [], []
        horizon, dim = self.model_cfg.action_horizon, self.model_cfg.action_dim
        for item in items:
            state = torch.as_tensor(item[self.model_cfg.state_key]).float()
            state = state[-1] if state.ndim == 2 else state
            if self.normalizer is not None:
                state = self.normalizer(state)
            states.append(_pad(state, self.state_width, "state"))
            chunk = torch.as_tensor(item["action"]).float()[:horizon]
            mask = torch.ones_like(chunk)
            if "action_is_pad" in item:
                mask = mask * (~torch.as_tensor(item["action_is_pad"]).bool()).float()[:, None]
            actions.append(_pad(chunk, dim, "action"))
            valid.append(_pad(mask, dim, "action"))
        return MlpBatch(torch.stack(states), torch.stack(actions), torch.stack(valid))


def samples_in(batch: MlpBatch, model_cfg: Any) -> int:
    """No tokens here: tokens_per_s counts samples."""
    return int(batch.state.shape[0])


class MlpRunner:
    """The evaluation side: predicts a chunk from the state, executes `execute_steps` of it, then observes again."""

    def __init__(self, model: MlpPolicy, config: Any, *, normalizer: Any, execute_steps: int, denoise_steps: int,
                 num_action_dims: int) -> None:
        self.model, self.config, self.normalizer = model.eval(), config, normalizer
        self.execute_steps, self.num_action_dims = execute_steps, num_action_dims
        self.queue: deque[np.ndarray] = deque()
        self.step: int | None = None

    def reset(self, task: str, seed: int) -> None:
        self.queue.clear()

    def act(self, obs: Mapping[str, Any]) -> np.ndarray:
        if not self.queue:
            state = self.normalizer(np.asarray(obs[self.config.model.state_key], np.float32))
            state = _pad(torch.as_tensor(np.asarray(state, np.float32)), self.model.state_width, "state")
            with torch.inference_mode():
                chunk = self.model.predict(state[None])[0, :, : self.num_action_dims].numpy()
            self.queue.extend(chunk[: self.execute_steps].astype(np.float32))
        return self.queue.popleft()
