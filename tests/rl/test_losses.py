"""GRPO / PPO advantages and losses (embodyhpc/rl/losses.py) against numbers worked out by hand in the comments, and
against an independent per-entry Python loop on random tensors."""

from __future__ import annotations

import math

import pytest
import torch

from embodyhpc.rl.losses import (
    decoupled_ppo_loss,
    gae,
    group_advantages,
    normalize_advantages,
    ppo_clip_loss,
    truncated_is_loss,
    value_loss,
)

LN = math.log


def entries(rows: list[list[list[float]]]) -> torch.Tensor:
    """[N][K][A] numbers as a [N, K, H=1, A] tensor."""
    return torch.tensor(rows, dtype=torch.float64)[:, :, None, :]


def test_group_advantages_standardise_within_each_group():
    # groups interleaved: 7 -> rewards 1, 0, 0, 1 (mean .5, population std .5); 3 -> 1, 1 (std 0: advantages 0);
    # 9 -> 0, .5 (mean .25, std .25). All rewards together have mean .5625 and std .4961: not what any group uses.
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 1.0])
    groups = torch.tensor([7, 3, 7, 9, 7, 3, 9, 7])
    eps = 1e-6
    expected = [0.5 / (0.5 + eps), 0.0, -0.5 / (0.5 + eps), -0.25 / (0.25 + eps), -0.5 / (0.5 + eps), 0.0,
                0.25 / (0.25 + eps), 0.5 / (0.5 + eps)]
    assert group_advantages(rewards, groups, eps=eps).tolist() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match="must both be"):
        group_advantages(rewards, groups[:3])


def test_gae_by_hand_stops_at_episode_ends():
    # gamma .9, lambda .8; V = .5, 1, .2 and bootstrap 3; the 2nd step ends its episode.
    # t=2: delta = 2 + .9 * 3 - .2 = 4.5;             A2 = 4.5
    # t=1: delta = 0 + (done: nothing) - 1 = -1;      A1 = -1 (the next episode's 4.5 is not carried over)
    # t=0: delta = 1 + .9 * 1 - .5 = 1.4;            A0 = 1.4 + .72 * -1 = .68;   returns = A + V
    adv, ret = gae(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.5, 1.0, 0.2, 3.0]), torch.tensor([0.0, 1.0, 0.0]),
                   gamma=0.9, lam=0.8)
    assert adv.tolist() == pytest.approx([0.68, -1.0, 4.5])
    assert ret.tolist() == pytest.approx([1.18, 0.0, 4.7])


def test_gae_over_envs_is_a_per_env_loop():
    g = torch.Generator().manual_seed(0)
    steps, envs, gamma, lam = 6, 3, 0.95, 0.9
    rewards, values = torch.rand(steps, envs, generator=g), torch.rand(steps + 1, envs, generator=g)
    dones = (torch.rand(steps, envs, generator=g) < 0.3).float()
    adv, ret = gae(rewards, values, dones, gamma, lam)
    for e in range(envs):
        for t in range(steps):  # A_t = sum_l (gamma lam)^l delta_{t+l}, stopping after the first done
            total, scale = 0.0, 1.0
            for u in range(t, steps):
                live = 1.0 - dones[u, e].item()
                total += scale * (rewards[u, e].item() + gamma * values[u + 1, e].item() * live - values[u, e].item())
                if not live:
                    break
                scale *= gamma * lam
            assert adv[t, e].item() == pytest.approx(total, abs=1e-5)
            assert ret[t, e].item() == pytest.approx(total + values[t, e].item(), abs=1e-5)


def test_ppo_clip_by_hand():
    # eps .2; N=2 samples, K=2 steps, A=2 dims. Step 1 log-ratios: sample 0 (A=+2): ln 1.5, ln .5; sample 1 (A=-1):
    # ln .5, ln 1.5. Step 2: ratio 1 everywhere. Per entry -min(r A, clip(r) A):
    #   s0: -min(3, 2.4) = -2.4 (clipped), -min(1, 1.6) = -1 (not);   s1: -min(-.5, -.8) = .8 (clipped),
    #   -min(-1.5, -1.2) = 1.5 (not: a negative advantage is not clipped above);  step 2: -2, -2, 1, 1.
    # mean over 8 entries = (-2.4 - 1 + .8 + 1.5 - 2 - 2 + 1 + 1) / 8 = -.3875
    old = torch.zeros(2, 2, 1, 2, dtype=torch.float64)
    new = entries([[[LN(1.5), LN(0.5)], [0, 0]], [[LN(0.5), LN(1.5)], [0, 0]]]).requires_grad_()
    loss, stats = ppo_clip_loss(new, old, torch.tensor([2.0, -1.0]), None, 0.2)
    assert loss.item() == pytest.approx(-0.3875)
    loss.backward()  # d/dlogp of -r A is -r A / 8 where the unclipped term is taken, 0 where the clip is
    assert new.grad[:, :, 0].flatten().tolist() == pytest.approx(
        [0.0, -0.5 * 2 / 8, -2 / 8, -2 / 8, 0.0, 1.5 / 8, 1 / 8, 1 / 8])
    assert stats["clip_fraction"].item() == pytest.approx(0.5)  # |r - 1| > .2 on the 4 entries of step 1
    kl = 2 * ((1.5 - 1) - LN(1.5)) + 2 * ((0.5 - 1) - LN(0.5))
    assert stats["approx_kl"].item() == pytest.approx(kl / 8)


def _ppo_loop(new, old, adv, mask, eps, weights=None):
    """Independent reference: one Python float per entry."""
    total, count = 0.0, 0.0
    n, k, h, a = new.shape
    for i in range(n):
        for s in range(k):
            for j in range(h):
                for d in range(a):
                    m = 1.0 if mask is None else float(mask[i, j, d])
                    r = math.exp(float(new[i, s, j, d]) - float(old[i, s, j, d]))
                    w = 1.0 if weights is None else float(weights[i, s, j, d])
                    total += m * w * -min(r * float(adv[i]), min(max(r, 1 - eps), 1 + eps) * float(adv[i]))
                    count += m
    return total / count


def test_ppo_clip_with_a_mask_is_the_per_entry_loop():
    g = torch.Generator().manual_seed(1)
    new, old = torch.randn(4, 3, 2, 2, generator=g) * 0.3, torch.randn(4, 3, 2, 2, generator=g) * 0.3
    adv = torch.randn(4, generator=g)
    mask = torch.rand(4, 2, 2, generator=g) < 0.6
    mask[3] = False  # a sample wholly padded: its (large) advantage must not count
    adv[3] = 100.0
    loss, _ = ppo_clip_loss(new, old, adv, mask, 0.2)
    assert loss.item() == pytest.approx(_ppo_loop(new, old, adv, mask, 0.2), abs=1e-5)
    with pytest.raises(ValueError, match=r"mask must be \[N, H, A\]"):
        ppo_clip_loss(new, old, adv, mask[:, :1], 0.2)
    with pytest.raises(ValueError, match="one per sample"):
        ppo_clip_loss(new, old, adv[:2], None, 0.2)


def test_decoupled_ppo_by_hand():
    # eps .2, cap 2; N=2, K=1, A=2. r = exp(new - prox), w = min(exp(prox - behav), 2), detached.
    #   s0 (A=+1): r 1.5, 1;  w min(3, 2) = 2, .5  -> 2 * -min(1.5, 1.2) = -2.4,  .5 * -1 = -.5
    #   s1 (A=-2): r .5, 1.1; w 1, min(3, 2) = 2   -> 1 * -min(-1, -1.6) = 1.6,   2 * -min(-2.2, -2.2) = 4.4
    # mean = (-2.4 - .5 + 1.6 + 4.4) / 4 = .775
    prox = entries([[[0.1, -0.2]], [[0.3, 0.0]]]).requires_grad_()
    new = (prox.detach() + entries([[[LN(1.5), 0.0]], [[LN(0.5), LN(1.1)]]])).requires_grad_()
    behav = (prox.detach() - entries([[[LN(3), LN(0.5)]], [[0.0, LN(3)]]])).requires_grad_()
    loss, stats = decoupled_ppo_loss(new, prox, behav, torch.tensor([1.0, -2.0]), None, 0.2, 2.0)
    assert loss.item() == pytest.approx(0.775)
    loss.backward()
    # only the unclipped entries carry a gradient, w * -r A / 4: s0 dim 1: .5 * -1 / 4; s1 dim 1: 2 * 2.2 / 4
    assert new.grad.flatten().tolist() == pytest.approx([0.0, -0.125, 0.0, 1.1])
    assert prox.grad is None and behav.grad is None  # both weights are constants of the update
    assert stats["behav_weight_mean"].item() == pytest.approx((2 + 0.5 + 1 + 2) / 4)
    assert stats["behav_capped_fraction"].item() == pytest.approx(0.5)
    # the loop reference agrees, with the capped weights it is given
    weights = torch.exp(prox - behav).detach().clamp(max=2.0)
    assert loss.item() == pytest.approx(_ppo_loop(new.detach(), prox.detach(), torch.tensor([1.0, -2.0]), None, 0.2,
                                                  weights))


def test_truncated_is_by_hand():
    # cap 2; N=2, K=1, A=2; rho = exp(new - behav): s0 (A=+1) 3, .5 -> w 2, .5; s1 (A=-1) 1, 4 -> w 1, 2.
    # loss per entry -w A: -2, -.5, 1, 2 -> mean .125; gradient -w A / 4 per entry (truncated, never zeroed)
    behav = entries([[[0.2, -0.1]], [[0.0, 0.4]]])
    new = (behav + entries([[[LN(3), LN(0.5)]], [[0.0, LN(4)]]])).requires_grad_()
    loss, stats = truncated_is_loss(new, behav, torch.tensor([1.0, -1.0]), None, 2.0)
    assert loss.item() == pytest.approx(0.125)
    loss.backward()
    assert new.grad.flatten().tolist() == pytest.approx([-0.5, -0.125, 0.25, 0.5])
    assert stats["truncated_fraction"].item() == pytest.approx(0.5)
    assert stats["is_weight_mean"].item() == pytest.approx(5.5 / 4)


def test_value_loss_by_hand():
    # V 1, 2, 0; R 1.5, 0, 1; V_old .8, 2.5, .5; clip .2 -> V_clipped 1, 2.3, .3
    # max of squared errors: max(.25, .25), max(4, 5.29), max(1, .49) -> .5 * mean = .5 * 6.54 / 3 = 1.09
    values = torch.tensor([1.0, 2.0, 0.0], requires_grad=True)
    returns, old = torch.tensor([1.5, 0.0, 1.0]), torch.tensor([0.8, 2.5, 0.5])
    assert value_loss(values, returns, old, 0.2).item() == pytest.approx(1.09)
    assert value_loss(values, returns, old, None).item() == pytest.approx(0.5 * (0.25 + 4 + 1) / 3)
    value_loss(values, returns, old, 0.2).backward()
    # d/dV: entry 0 (both equal: unclipped branch) (V - R) / 3; entry 1 the clipped branch is constant in V
    # (2 - 2.5 = -.5 is clamped to -.2): 0; entry 2 unclipped: (0 - 1) / 3
    assert values.grad.tolist() == pytest.approx([-0.5 / 3, 0.0, -1 / 3])


def test_ppo_advantages_normalised_over_a_batch_by_hand():
    # 3, -1, 1, 1: mean 1, deviations 2, -2, 0, 0, population std sqrt(8/4) = sqrt(2)
    adv = normalize_advantages(torch.tensor([3.0, -1.0, 1.0, 1.0]), eps=0.0)
    assert adv.tolist() == pytest.approx([2 / math.sqrt(2), -2 / math.sqrt(2), 0.0, 0.0], abs=1e-6)
    # a zero critic: a success's GAE advantages (0.9405, 1) against a failure's (0, 0) become a success above and a
    # failure below the batch mean, where unnormalised the failure carried no signal at all
    mixed = normalize_advantages(torch.tensor([0.9405, 1.0, 0.0, 0.0]))
    assert mixed[:2].min() > 0 > mixed[2:].max() and float(mixed.sum()) == pytest.approx(0.0, abs=1e-6)
    assert normalize_advantages(torch.tensor([0.7, 0.7, 0.7])).tolist() == [0.0, 0.0, 0.0]  # no spread: no signal
    assert normalize_advantages(torch.tensor([5.0])).tolist() == [0.0]
    assert normalize_advantages(torch.zeros(0)).numel() == 0
    with pytest.raises(ValueError, match="must be"):
        normalize_advantages(torch.zeros(2, 2))
