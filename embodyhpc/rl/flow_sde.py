"""Flow-SDE: the flow-matching policy made stochastic and scoreable for RL (πRL's "flow-SDE", Flow-GRPO's SDE).

Convention inside `rl`: time t in [0, 1], t = 1 pure noise, t = 0 the action; the velocity v = dx/dt in this
convention (pi0.5's own; GR00T's flow_velocity_fn converts). The sampler goes from t = 1 to 0 in K equal steps,
t_k = 1 + k * dt with dt = -1 / K (k = 0 .. K-1), exactly the times the families' ODE samplers use.

The flow's path x_t = (1 - t) * action + t * noise has the score grad log p_t(x) = -(x + (1 - t) * v) / t (the
predicted noise over t). The SDE, integrated backwards in time with the same marginals p_t as the ODE dx = v dt, is
    dx = [v - sigma_t^2 / 2 * grad log p_t(x)] dt + sigma_t dW,    sigma_t = a * sqrt(t / (1 - t)),
a = noise_level. One Euler-Maruyama step (dt < 0) is the Gaussian transition
    x' ~ N(x + dt * [v + sigma_t^2 / (2 t) * (x + (1 - t) * v)],  (sigma_t * sqrt(-dt))^2),
so every denoising step has an exact log-density; a = 0 is the deterministic Euler step of the ODE sampler.

The clamp near t = 1 (sigma_t is infinite there): 1 - t is clamped below by -dt, the length of one step. On the
sampler's grid this changes only the first step (t = 1), which then uses 1 - t_1 = 1/K, exactly what Flow-GRPO
(sigma_max = sigmas[1]) and RLinf (torch.where(t == 1, t_1, t)) do; it gives that step the standard deviation
a * sqrt(-dt) * sqrt(1 / -dt) = a, i.e. noise_level is the std of the first transition, whatever K. Written as a
clamp rather than a lookup it is defined for any t, which trajectory_log_prob needs nothing more of.

Log-probabilities are per entry ("token-level"): log_prob[n, k, h, a] is the Gaussian log-density of entry (h, a)
of step k's transition; the losses take ratios per entry and average.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""v(x [N, H, A], t [N] float64) -> [N, H, A]: what model.flow_velocity_fn(batch) returns."""

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SdeSample:
    actions: torch.Tensor  # [N, H, A]: x_K, the action chunk
    trajectory: torch.Tensor  # [N, K+1, H, A]: x_0 = noise, ..., x_K = actions
    log_prob: torch.Tensor  # [N, K, H, A]: log-density of each entry of each transition taken (0 when a = 0)


def step_times(num_steps: int, *, device: torch.device | str = "cpu") -> tuple[torch.Tensor, float]:
    """The sampler's times t_k = 1 + k * dt (k = 0 .. K-1) as float64 [K], and dt = -1 / K (a Python float), computed
    as the families' ODE samplers compute them (so a = 0 reproduces sample_actions)."""
    if int(num_steps) < 1:
        raise ValueError(f"num_steps={num_steps}: need at least one denoising step (rl.denoise_steps >= 1)")
    dt = -1.0 / int(num_steps)
    return torch.tensor([1.0 + k * dt for k in range(int(num_steps))], dtype=torch.float64, device=device), dt


def sde_step_stats(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor | float, dt: float,
                   noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the Euler-Maruyama transition from x at time t over dt < 0 (module docstring), each shaped
    like x (std broadcastable to it). `t`: a float, or a tensor whose shape is a prefix of x's ([N] for x [N, H, A],
    [1, K] or [N, K] for x [N, K, H, A]). Computed in x's dtype."""
    dt = float(dt)
    if not dt < 0.0:
        raise ValueError(f"dt={dt}: the sampler runs from t = 1 (noise) to t = 0, dt must be negative")
    if noise_level < 0.0:
        raise ValueError(f"noise_level={noise_level} must be >= 0 (rl.noise_level)")
    t = torch.as_tensor(t, device=x.device).to(x.dtype)
    t = t.reshape(*t.shape, *([1] * (x.ndim - t.ndim)))
    one_minus_t = (1.0 - t).clamp(min=-dt)  # sigma_t is infinite at t = 1: see the module docstring
    sigma_sq = noise_level ** 2 * t / one_minus_t
    drift = v + sigma_sq / (2.0 * t) * (x + (1.0 - t) * v)
    mean = x + dt * drift
    std = (sigma_sq * -dt).sqrt()
    return mean, std


def gaussian_log_prob(value: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-entry log N(value; mean, std^2)."""
    return -((value - mean) ** 2) / (2.0 * std ** 2) - std.log() - _HALF_LOG_2PI


def sample_chunk(velocity_fn: VelocityFn, noise: torch.Tensor, *, num_steps: int, noise_level: float,
                 generator: torch.Generator | None) -> SdeSample:
    """K stochastic denoising steps from `noise` [N, H, A] with velocity_fn (model.flow_velocity_fn(batch)); each
    step's Gaussian draw comes from `generator` (on its own device, then moved). noise_level 0 is the ODE sampler
    (log_prob then 0: a point mass has no density). Gradients flow if the caller enables them."""
    if noise.ndim != 3:
        raise ValueError(f"noise must be [N, H, A], got {tuple(noise.shape)}")
    times, dt = step_times(num_steps, device=noise.device)
    n = noise.shape[0]
    x = noise.float()
    trajectory, log_probs = [x], []
    for k in range(int(num_steps)):
        t = times[k].expand(n)
        mean, std = sde_step_stats(x, velocity_fn(x, t), t, dt, noise_level)
        if noise_level > 0.0:
            gen_device = generator.device if generator is not None else x.device
            z = torch.randn(x.shape, generator=generator, device=gen_device).to(x.device)
            x = mean + std * z
            log_probs.append(gaussian_log_prob(x, mean, std))
        else:
            x = mean
            log_probs.append(torch.zeros_like(x))
        trajectory.append(x)
    return SdeSample(actions=x, trajectory=torch.stack(trajectory, dim=1), log_prob=torch.stack(log_probs, dim=1))


def trajectory_log_prob(model: Any, batch: Any, trajectory: torch.Tensor, *, noise_level: float) -> torch.Tensor:
    """[N, K, H, A]: log-density of each entry of each transition of `trajectory` [N, K+1, H, A] under the current
    model, with gradients (one model.flow_velocities call for the K steps: the actor's FSDP forward method)."""
    if trajectory.ndim != 4 or trajectory.shape[1] < 2:
        raise ValueError(f"trajectory must be [N, K+1, H, A] with K >= 1, got {tuple(trajectory.shape)}")
    if not noise_level > 0.0:
        raise ValueError(f"noise_level={noise_level}: a deterministic (noise_level 0) step has no density; "
                         "set rl.noise_level > 0")
    trajectory = trajectory.float()
    num_steps = trajectory.shape[1] - 1
    times, dt = step_times(num_steps, device=trajectory.device)
    x = trajectory[:, :-1]
    velocities = model.flow_velocities(batch, x, times)
    if velocities.shape != x.shape:
        raise ValueError(f"model.flow_velocities returned {tuple(velocities.shape)}, expected {tuple(x.shape)}")
    mean, std = sde_step_stats(x, velocities, times[None, :], dt, noise_level)
    return gaussian_log_prob(trajectory[:, 1:], mean, std)
