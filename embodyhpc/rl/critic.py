"""PPO's value head: V(state, task) from the normalised robot state and the task's index, independent of the model
family (pi0.5 and GR00T train the same critic beside their policy).

A small MLP on [state | embedding(task)]: the state is what the policy reads after the recipe's normalisation (the
actor passes its normalizer's output), the task index is the position of the episode's task in the run's task list
(so one critic serves a multi-task suite). Its parameters are the actor's, trained with rl.value_lr. The output layer
starts at zero: every value is 0 before the first update (the return of a success-only reward lies in [0, 1]).
`ValueHead` is the actor's side of it: inputs, GAE, the value loss, the optimizer step and the critic's files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from embodyhpc.rl import losses


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


CRITIC_FILE = "critic-step-{version}.pt"
OUT_OF_RANGE = 10.0
"""rl/state_out_of_range: the share of a version's samples with a normalised state entry beyond +-OUT_OF_RANGE. A
mean_std normaliser divides by the demonstrations' spread: a dimension the demonstrations hardly moved (MetaWorld
reach-v3: the gripper opening, std 1e-3; the untouched puck's orientation, std 1e-5) becomes 10^2-10^4 once an
exploring policy moves it. The critic reads such states as the policy does, unclipped: clipping its input to +-10
(Stable-Baselines3 VecNormalize's clip_obs) was tried on 2026-11-27 and the PPO closed loop ended at 12/48 and 38/48
held-out in its two runs, against 48/48 in the run beside them without it."""


class ValueHead:
    """PPO's critic as the actor trains it: the Critic on the policy's normalised state (model.state_key through the
    actor's normaliser) and the episode's task, its AdamW (rl.value_lr), GAE advantages of finished episodes, the
    value loss, and its file beside the policy's checkpoints (critic-step-<version>.pt in the checkpoint root, kept
    exactly as long as the step folder it belongs to, written atomically, loaded on resume)."""

    def __init__(self, config, normalizer, raw_state_dim: int, device: torch.device, root: Path) -> None:
        from embodyhpc.rl.env_worker import EpisodePlan

        self.rl, self.state_key, self.normalizer = config.rl, config.model.state_key, normalizer
        self.device, self.root = device, Path(root)
        self.plan = EpisodePlan(tuple(config.eval.tasks), tuple(self.rl.train_seeds), self.rl.group_size, 1, 1)
        state_dim = len(normalizer(np.zeros(raw_state_dim, np.float32)))
        self.critic = Critic(state_dim, len(self.plan.tasks)).to(device)
        self.optimizer = torch.optim.AdamW(self.critic.parameters(), lr=self.rl.value_lr)

    def inputs(self, samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised states [N, state_dim], task indices [N]) of chunk samples."""
        states = torch.stack([torch.as_tensor(np.asarray(self.normalizer(np.asarray(s.observation[self.state_key],
                                                                                    np.float32)), np.float32))
                              for s in samples]).to(self.device)
        tasks = torch.tensor([self.plan.tasks.index(self.plan.initial_state(s.episode_id)[0]) for s in samples],
                             device=self.device)
        return states, tasks

    def out_of_range(self, samples: list) -> int:
        """How many samples have a normalised state entry beyond +-OUT_OF_RANGE (rl/state_out_of_range: their
        share)."""
        if not samples:
            return 0
        return int((self.inputs(samples)[0].abs() > OUT_OF_RANGE).any(dim=-1).sum())

    def file(self, version: int) -> Path:
        return self.root / CRITIC_FILE.format(version=version)

    def load(self, version: int) -> bool:
        """The critic saved with the policy's checkpoint `version`; False when there is none."""
        path = self.file(version)
        if not path.is_file():
            return False
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.critic.load_state_dict(state["critic"])
        self.optimizer.load_state_dict(state["optimizer"])
        return True

    def save(self, version: int) -> None:
        """Rank 0: write critic-step-<version>.pt (a temporary file renamed: a crash never leaves half a file), then
        remove the critic files of versions whose policy checkpoint folder is gone (the Checkpointer's retention,
        checkpoint.keep_latest_k): a resume finds the critic of every checkpoint it can load, and no others."""
        from embodyhpc.checkpoint import layout

        path = self.file(version)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"critic": self.critic.state_dict(), "optimizer": self.optimizer.state_dict()}, tmp)
        os.replace(tmp, path)
        listing = layout.list_steps(self.root)
        kept = {version, *listing.complete, *listing.incomplete}
        for old in self.root.glob(CRITIC_FILE.format(version="*")):
            step = old.name[len("critic-step-"):-len(".pt")]
            if step.isdigit() and int(step) not in kept:
                old.unlink(missing_ok=True)

    def advantages(self, samples: list, success: bool) -> list[float]:
        """GAE over one finished episode's chunk samples (in order): reward = success at its last chunk, 0 before,
        nothing bootstrapped after it. Each sample keeps its return and value (observation _return, _value) for the
        value loss and rl/explained_variance."""
        rewards = torch.zeros(len(samples))
        rewards[-1] = float(success)
        with torch.no_grad():
            values = self.critic(*self.inputs(samples)).float().cpu()
        values = torch.cat([values, torch.zeros(1)])
        dones = torch.zeros(len(samples))
        dones[-1] = 1.0
        adv, returns = losses.gae(rewards, values, dones, self.rl.gamma, self.rl.gae_lambda)
        for sample, ret, value in zip(samples, returns.tolist(), values.tolist(), strict=False):
            sample.observation["_return"] = np.float32(ret)
            sample.observation["_value"] = np.float32(value)
        return adv.tolist()

    def loss(self, samples: list) -> torch.Tensor:
        """The clipped value loss (losses.value_loss, clip rl.clip_eps) of samples that carry _return and _value."""
        returns = torch.tensor([float(s.observation["_return"]) for s in samples], device=self.device)
        old = torch.tensor([float(s.observation["_value"]) for s in samples], device=self.device)
        return losses.value_loss(self.critic(*self.inputs(samples)), returns, old, self.rl.clip_eps)

    def step(self, world: int, group, max_norm: float) -> float:
        """The critic is not sharded: its gradients are averaged over the actor ranks, clipped to `max_norm` (the
        policy's train.grad_clip, on the critic's own norm: its loss and optimizer are its own; <= 0: no clip), then
        its optimizer steps. Returns the norm before clipping (loss/value_grad_norm)."""
        if world > 1:
            import torch.distributed as dist

            for param in self.critic.parameters():
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, group=group)
                param.grad.div_(world)
        norm = torch.nn.utils.clip_grad_norm_(list(self.critic.parameters()),
                                              max_norm if max_norm > 0 else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def parameters(self):
        return self.critic.parameters()
