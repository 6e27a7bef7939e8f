"""GRPO and PPO for the flow policy: advantages, returns and the actor / critic losses (plain torch).

Shapes. The actor's log-probabilities are per entry (flow_sde.py): [N, K, H, A] (samples, denoising steps, chunk
steps, action dims). An advantage is per sample [N] and is broadcast over [K, H, A]; a mask is [N, H, A] (1 on the
entries that count: not a padded chunk step or action dim) broadcast over K, or None for all ones. Every actor loss
is the mean over the counted entries (token-level: each entry of each denoising step weighs the same). Stats are
detached 0-d tensors (call .item() when logging).
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean of its group) / (std of its group + eps), population std; a group whose rewards are all equal
    gets 0 advantages. rewards [M] float, group_ids [M] int (any values)."""
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must both be [M]")
    rewards = rewards.double()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=torch.float64, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards))
    mean = torch.zeros_like(count).index_add_(0, inverse, rewards) / count
    centred = rewards - mean[inverse]
    var = torch.zeros_like(count).index_add_(0, inverse, centred ** 2) / count
    return (centred / (var.sqrt()[inverse] + eps)).float()


def normalize_advantages(adv: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """PPO's per-batch advantage normalisation (as SB3's normalize_advantage and CleanRL's norm_adv): (a - mean) /
    (std + eps) over the batch, population std. A batch without spread (one sample, or all equal) is only centred:
    every advantage 0, no gradient, rather than a division by zero. adv [N] -> [N] float32."""
    if adv.ndim != 1:
        raise ValueError(f"advantages must be [N], got {tuple(adv.shape)}")
    adv = adv.double()
    centred = adv - adv.mean() if adv.numel() else adv
    std = centred.pow(2).mean().sqrt() if adv.numel() else adv.new_zeros(())
    return (centred / (std + eps) if float(std) > eps else torch.zeros_like(centred)).float()


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over time (dim 0): rewards [T, ...], values [T+1, ...] (V of every state, the
    last one the bootstrap), dones [T, ...] (1 where the step ended its episode: nothing after it is bootstrapped).
    Returns (advantages [T, ...], returns = advantages + values[:T])."""
    if values.shape[0] != rewards.shape[0] + 1 or dones.shape != rewards.shape:
        raise ValueError(f"gae needs rewards [T], values [T+1], dones [T]; got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(dones.shape)}")
    rewards, values = rewards.float(), values.float()
    live = 1.0 - dones.float()
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[0])
    for t in range(rewards.shape[0] - 1, -1, -1):
        delta = rewards[t] + gamma * values[t + 1] * live[t] - values[t]
        running = delta + gamma * lam * live[t] * running
        advantages[t] = running
    return advantages, advantages + values[:-1]


def _entry_weights(logp: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask broadcast to logp's [N, K, H, A] as float, the number of counted entries (at least 1))."""
    if logp.ndim != 4:
        raise ValueError(f"log-probabilities must be [N, K, H, A], got {tuple(logp.shape)}")
    if mask is None:
        weights = torch.ones_like(logp)
    else:
        if mask.shape != (logp.shape[0], *logp.shape[2:]):
            raise ValueError(f"mask must be [N, H, A] = {(logp.shape[0], *logp.shape[2:])}, got {tuple(mask.shape)}")
        weights = mask.to(logp.dtype)[:, None].expand_as(logp)
    return weights, weights.sum().clamp(min=1.0)


def _per_entry_advantage(adv: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    if adv.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be one per sample [{logp.shape[0]}], got {tuple(adv.shape)}")
    return adv.to(logp.dtype).detach()[:, None, None, None]


def _masked_mean(values: torch.Tensor, weights: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / count


def _clipped_surrogate(log_ratio: torch.Tensor, adv: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, ...]:
    """Per entry: (-min(ratio * A, clip(ratio, 1 -+ eps) * A), ratio, whether the clip is active)."""
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * adv
    return -torch.minimum(unclipped, clipped), ratio, ((ratio - 1.0).abs() > clip_eps)


def ppo_clip_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor | None,
                  clip_eps: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate, ratio = exp(new - old) per entry. stats: clip_fraction (share of counted entries
    with |ratio - 1| > clip_eps), approx_kl (mean of (ratio - 1) - log ratio, an unbiased KL(old || new) estimate)."""
    weights, count = _entry_weights(logp_new, mask)
    log_ratio = logp_new - logp_old.detach()
    per_entry, ratio, clipped = _clipped_surrogate(log_ratio, _per_entry_advantage(adv, logp_new), clip_eps)
    stats = {"clip_fraction": _masked_mean(clipped.to(weights.dtype), weights, count).detach(),
             "approx_kl": _masked_mean((ratio - 1.0) - log_ratio, weights, count).detach()}
    return _masked_mean(per_entry, weights, count), stats


def decoupled_ppo_loss(logp_new: torch.Tensor, logp_prox: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor,
                       mask: torch.Tensor | None, clip_eps: float,
                       behav_cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (AReaL) for stale samples: the clipped surrogate around the proximal policy (the actor's weights
    before this update), ratio = exp(new - prox), each entry weighted by the behaviour importance weight
    min(exp(prox - behav), behav_cap), detached (behav: the rollout policy that produced the sample). stats:
    clip_fraction, approx_kl (new vs prox), behav_weight_mean, behav_capped_fraction."""
    weights, count = _entry_weights(logp_new, mask)
    log_ratio = logp_new - logp_prox.detach()
    per_entry, ratio, clipped = _clipped_surrogate(log_ratio, _per_entry_advantage(adv, logp_new), clip_eps)
    raw_weight = (logp_prox - logp_behav).detach().exp()
    behav_weight = raw_weight.clamp(max=behav_cap)
    stats = {"clip_fraction": _masked_mean(clipped.to(weights.dtype), weights, count).detach(),
             "approx_kl": _masked_mean((ratio - 1.0) - log_ratio, weights, count).detach(),
             "behav_weight_mean": _masked_mean(behav_weight, weights, count),
             "behav_capped_fraction": _masked_mean((raw_weight > behav_cap).to(weights.dtype), weights, count)}
    return _masked_mean(behav_weight * per_entry, weights, count), stats


def truncated_is_loss(logp_new: torch.Tensor, logp_behav: torch.Tensor, adv: torch.Tensor,
                      mask: torch.Tensor | None, cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO's off-policy correction: the policy gradient with truncated importance weights. Per entry the loss is
    -w * A with w = min(exp(new - behav), cap) detached, written so that its gradient is -w * A * grad(logp_new)
    (the weight truncates the step size of a stale sample, it never zeroes its gradient). stats: is_weight_mean,
    truncated_fraction, approx_kl (behav vs new)."""
    weights, count = _entry_weights(logp_new, mask)
    log_ratio = (logp_new - logp_behav).detach()
    raw_weight = log_ratio.exp()
    is_weight = raw_weight.clamp(max=cap)
    score = (logp_new - logp_new.detach()).exp()  # 1 in value, grad(logp_new) in gradient
    per_entry = -is_weight * score * _per_entry_advantage(adv, logp_new)
    stats = {"is_weight_mean": _masked_mean(is_weight, weights, count),
             "truncated_fraction": _masked_mean((raw_weight > cap).to(weights.dtype), weights, count),
             "approx_kl": _masked_mean((raw_weight - 1.0) - log_ratio, weights, count)}
    return _masked_mean(per_entry, weights, count), stats


def value_loss(values: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor,
               clip: float | None) -> torch.Tensor:
    """PPO's value loss: 0.5 * mean(max((V - R)^2, (V_clipped - R)^2)), V_clipped = V_old + clip(V - V_old, -clip,
    clip); clip None or <= 0: 0.5 * mean((V - R)^2). All [N]."""
    if values.shape != returns.shape or old_values.shape != values.shape:
        raise ValueError(f"values {tuple(values.shape)}, returns {tuple(returns.shape)} and old_values "
                         f"{tuple(old_values.shape)} must have one shape")
    returns, old_values = returns.detach().to(values.dtype), old_values.detach().to(values.dtype)
    squared = (values - returns) ** 2
    if clip is not None and clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        squared = torch.maximum(squared, (clipped - returns) ** 2)
    return 0.5 * squared.mean()
