"""pi0.5's flow-matching conventions against their formulas (openpi's pi0.5, written out here, not taken from our
code): the time distribution, the sinusoidal time embedding, Gemma's RMSNorm and the adaRMS modulation, and Euler
integration from t = 1 (noise) to t = 0 (data) under a constant velocity field.
The model-level check of the same conventions against LeRobot's port is tests/models/test_reference_pi05.py.
"""

from __future__ import annotations

import math

import torch

from embodyhpc.models.norms import OffsetRMSNorm
from embodyhpc.models.pi05 import Pi05Batch, Pi05Policy
from embodyhpc.models.pi05.layers import AdaRMSNorm, TimeCondition
from embodyhpc.models.pi05.model import sample_time, time_embedding
from embodyhpc.models.pi05.shapes import Pi05Shape, StreamShape
from embodyhpc.models.shapes import VisionShape

# openpi: t = Beta(1.5, 1) * 0.999 + 0.001
ALPHA, SCALE, OFFSET = 1.5, 0.999, 0.001


def test_time_sampling_follows_the_scaled_beta_distribution() -> None:
    """t = 0.999 * b + 0.001, b ~ Beta(1.5, 1): CDF((t - 0.001) / 0.999) = ((t - 0.001) / 0.999) ** 1.5, mean 0.6004.
    400k draws: the mean within 5 standard errors, the largest CDF gap (Kolmogorov-Smirnov) below its p = 0.001
    critical value 1.95 / sqrt(n), and the support [0.001, 1] reached at both ends."""
    n = 400_000
    t = sample_time(n, generator=torch.Generator().manual_seed(0)).double()
    beta_mean, beta_var = ALPHA / (ALPHA + 1), ALPHA / ((ALPHA + 1) ** 2 * (ALPHA + 2))
    mean, std_error = SCALE * beta_mean + OFFSET, SCALE * math.sqrt(beta_var / n)
    assert abs(t.mean().item() - mean) < 5 * std_error, (t.mean().item(), mean)
    assert OFFSET <= t.min().item() < OFFSET + 1e-3 and 1.0 - 1e-3 < t.max().item() <= 1.0, (t.min(), t.max())
    cdf = ((t.sort().values - OFFSET) / SCALE).clamp(0, 1) ** ALPHA
    empirical = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = torch.maximum((cdf - empirical).abs(), (cdf - (empirical - 1 / n)).abs()).max().item()
    assert ks < 1.95 / math.sqrt(n), ks
    for q in (0.05, 0.5, 0.95):  # quantiles: 0.999 * q ** (1 / 1.5) + 0.001, within 0.005
        assert abs(t.quantile(q).item() - (SCALE * q ** (1 / ALPHA) + OFFSET)) < 5e-3, q


def test_time_embedding_is_sin_then_cos_over_log_spaced_periods() -> None:
    """emb(t)[i] = sin(2 pi t / p_i), emb(t)[k + i] = cos(2 pi t / p_i), p_i = 4e-3 * (4 / 4e-3) ** (i / (k - 1))."""
    dim, time = 8, torch.tensor([0.0, 0.001, 0.37, 0.999, 1.0])
    times = time.double().tolist()  # the float32 times exactly: at 2 pi / 4e-3 their rounding would show
    k = dim // 2
    periods = [4e-3 * (4.0 / 4e-3) ** (i / (k - 1)) for i in range(k)]
    angles = [[2 * math.pi * t / p for p in periods] for t in times]
    expected = torch.tensor([[math.sin(a) for a in row] + [math.cos(a) for a in row] for row in angles],
                            dtype=torch.float64)
    torch.testing.assert_close(time_embedding(time, dim).double(), expected, atol=1e-6, rtol=0)


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return module


def test_gemma_rmsnorm_scales_by_one_plus_weight() -> None:
    dim, eps = 8, 1e-6
    norm = _randomised(OffsetRMSNorm(dim, eps), 1)
    x = torch.randn(3, 5, dim, generator=torch.Generator().manual_seed(2)) * 3
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + norm.weight)
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-5)


def test_adarms_modulation_rows_are_scale_shift_gate() -> None:
    """The published `dense` of openpi's adaRMS gives [scale | shift | gate] (torch.chunk(3)):
    y = x_hat * (1 + scale) + shift and the gate returned for the residual branch; per sample, gathered per token;
    padding tokens (sample index N) get scale = shift = gate = 0."""
    dim, cond_dim, eps = 8, 5, 1e-6
    norm = _randomised(AdaRMSNorm(dim, cond_dim, eps), 3)
    g = torch.Generator().manual_seed(4)
    cond = torch.randn(2, cond_dim, generator=g)
    token_sample = torch.tensor([[0, 1, 1, 2]])  # tokens of samples 0, 1, 1, then a padding token
    x = torch.randn(1, 4, dim, generator=g) * 2
    y, gate = norm(x, TimeCondition(per_sample=cond, token_sample=token_sample))

    modulation = cond @ norm.modulation.weight.T + norm.modulation.bias  # [2, 3 * dim]
    x_hat = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    for token, sample in enumerate(token_sample[0].tolist()):
        if sample < 2:
            scale, shift, gate_ = modulation[sample].split(dim)
        else:
            scale = shift = gate_ = torch.zeros(dim)
        torch.testing.assert_close(y[0, token], x_hat[0, token] * (1 + scale) + shift, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(gate[0, token], gate_, atol=1e-6, rtol=1e-5)


def test_euler_integration_under_a_constant_velocity_field() -> None:
    """dx/dt = c from x(1) = noise to t = 0: x(0) = noise - c, for any number of steps (Euler is exact here).
    The model's velocity is made the constant c by zeroing action_out's weight and setting its bias to c."""
    shape = Pi05Shape(vision=VisionShape(image_size=16, patch_size=8, width=16, depth=1, num_heads=2, mlp_dim=16),
                      vlm=StreamShape(width=16, mlp_dim=16), expert=StreamShape(width=16, mlp_dim=16),
                      depth=1, num_heads=2, num_kv_heads=1, head_dim=8, vocab_size=16)
    torch.manual_seed(0)
    model = Pi05Policy(shape, action_horizon=4, action_dim=3).eval()
    c = torch.tensor([0.5, -1.25, 2.0])
    with torch.no_grad():
        model.action_out.weight.zero_()
        model.action_out.bias.copy_(c)
    batch = Pi05Batch(images=torch.rand(2, 1, 3, 16, 16), prompt_ids=torch.ones(2, 3, dtype=torch.long),
                      prompt_lengths=torch.tensor([3, 2]))
    noise = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(5))
    for steps in (1, 4):
        torch.testing.assert_close(model.sample_actions(batch, num_steps=steps, noise=noise), noise - c)
