"""PPO's value head: V(state, task) from the normalised robot state and the task's index, independent of the model
family (pi0.5 and GR00T train the same critic beside their policy).

A small MLP on [state | embedding(task)]: the state is what the policy reads after the recipe's normalisation (the
actor passes its normalizer's output), the task index is the position of the episode's task in the run's task list
(so one critic serves a multi-task suite). Its parameters are the actor's, trained with rl.value_lr. The output layer
starts at zero: every value is 0 before the first update (the return of a success-only reward lies in [0, 1]).
"""

from __future__ import annotations

import torch
from torch import nn


class Critic(nn.Module):
    def __init__(self, state_dim: int, num_tasks: int, *, hidden: int = 256, task_dim: int = 32,
                 depth: int = 2) -> None:
        super().__init__()
        if state_dim < 0 or num_tasks < 1 or hidden < 1 or task_dim < 1 or depth < 1:
            raise ValueError(f"Critic(state_dim={state_dim}, num_tasks={num_tasks}, hidden={hidden}, "
                             f"task_dim={task_dim}, depth={depth}): need state_dim >= 0 and the others >= 1")
        self.state_dim, self.num_tasks = state_dim, num_tasks
        self.task_embedding = nn.Embedding(num_tasks, task_dim)
        layers: list[nn.Module] = []
        width = state_dim + task_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.SiLU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.out = nn.Linear(hidden, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, state: torch.Tensor, task: torch.Tensor) -> torch.Tensor:
        """state [N, state_dim] (normalised), task [N] int in [0, num_tasks) -> values [N] float32."""
        if state.ndim != 2 or state.shape[1] != self.state_dim:
            raise ValueError(f"the critic reads states [N, {self.state_dim}], got {tuple(state.shape)}: build it with "
                             "the policy's state dimension")
        if task.shape != state.shape[:1]:
            raise ValueError(f"one task index per state: {tuple(task.shape)} for {state.shape[0]} states")
        if task.numel() and (int(task.min()) < 0 or int(task.max()) >= self.num_tasks):
            raise ValueError(f"task indices must be in [0, {self.num_tasks}) (the run's tasks), got "
                             f"{int(task.min())}..{int(task.max())}")
        weight = self.out.weight
        features = torch.cat([state.to(weight.dtype), self.task_embedding(task.long())], dim=-1)
        return self.out(self.body(features)).squeeze(-1).float()


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float | None:
    """How much of the returns' variance the critic's values (those the advantages were computed with) explain:
    1 - Var(returns - values) / Var(returns). 1: perfect, 0: no better than a constant, < 0: worse than one. None when
    it is undefined (fewer than two samples, or returns without variance: a round of equal outcomes)."""
    returns, values = returns.double().flatten(), values.double().flatten()
    if returns.shape != values.shape:
        raise ValueError(f"one value per return: {tuple(values.shape)} values for {tuple(returns.shape)} returns")
    if returns.numel() < 2:
        return None
    spread = returns.var(unbiased=False)
    if not float(spread) > 0.0:
        return None
    return float(1.0 - (returns - values).var(unbiased=False) / spread)
