"""The flow-matching loss both model families train with: a velocity regressed onto its target over the action
entries a batch counts (padded chunk steps and padded action dimensions excluded), averaged per sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FlowMatchingOutput:
    loss: torch.Tensor  # scalar: mean of per_sample_loss
    per_sample_loss: torch.Tensor  # [N]


def training_actions(actions: torch.Tensor | None, action_horizon: int, action_dim: int) -> torch.Tensor:
    """A training batch's actions as float32 [N, action_horizon, action_dim]; ValueError when it has none or another
    shape (naming the recipe keys)."""
    if actions is None:
        raise ValueError("training needs batch.actions; use sample_actions for inference")
    if tuple(actions.shape[1:]) != (action_horizon, action_dim):
        raise ValueError(f"actions are {tuple(actions.shape[1:])} per sample, the model predicts "
                         f"({action_horizon}, {action_dim}) (model.action_horizon, model.action_dim)")
    return actions.float()


def action_loss_mask(actions: torch.Tensor, action_is_pad: torch.Tensor | None,
                     action_dim_mask: torch.Tensor | None) -> torch.Tensor:
    """[N, H, A] float: 1 on the entries the loss counts (not a padded step [N, H], not a padded dimension [N, A])."""
    mask = torch.ones_like(actions, dtype=torch.float32)
    if action_is_pad is not None:
        mask = mask * (~action_is_pad.bool())[:, :, None]
    if action_dim_mask is not None:
        mask = mask * action_dim_mask.bool()[:, None, :]
    return mask


def masked_flow_loss(velocity: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> FlowMatchingOutput:
    """Mean squared error over each sample's counted entries, then the mean over samples."""
    squared = (velocity - target).pow(2) * mask
    per_sample = squared.sum((1, 2)) / mask.sum((1, 2)).clamp(min=1.0)
    return FlowMatchingOutput(loss=per_sample.mean(), per_sample_loss=per_sample)
