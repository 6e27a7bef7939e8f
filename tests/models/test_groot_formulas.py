"""GR00T-N1.5's formulas against their closed forms: the training-time distribution (analytic mean, quantiles and
CDF), the Euler integrator (fields whose integral is known), AdaLN and the DiT's output modulation (the formula and
the published parameter layout: which half of the linear's output is scale and which shift)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model
from embodyhpc.models.groot.batch import GrootSample, collate
from embodyhpc.models.groot.head import DiT
from embodyhpc.models.groot.layers import AdaLayerNorm
from embodyhpc.models.groot.model import sample_time
from embodyhpc.models.groot.shapes import GrootShape, shape_for

# Isaac-GR00T N1.5's action_head_cfg: t = (s - B) / s, B ~ Beta(alpha, beta)
ALPHA, BETA, S = 1.5, 1.0, 0.999
HORIZON, ACTION_DIM = 16, 4


def t_quantile(q: float) -> float:
    """t decreases in B, so t's q-quantile is (s - B's (1 - q)-quantile) / s; Beta(a, 1) has CDF x**a."""
    return (S - (1.0 - q) ** (1.0 / ALPHA)) / S


def t_cdf(x: torch.Tensor) -> torch.Tensor:
    """P(t <= x) = P(B >= s (1 - x)) = 1 - (s (1 - x)) ** a on its support."""
    return 1.0 - (S * (1.0 - x)).clamp(0.0, 1.0) ** ALPHA


def test_the_training_time_has_the_analytic_mean_quantiles_and_cdf():
    n = 100_000
    t = sample_time(n, generator=torch.Generator().manual_seed(0)).double().sort().values
    mean = (S - ALPHA / (ALPHA + BETA)) / S  # 0.3994
    std = math.sqrt(ALPHA * BETA / ((ALPHA + BETA) ** 2 * (ALPHA + BETA + 1))) / S
    assert abs(t.mean().item() - mean) < 5 * std / math.sqrt(n)  # 5 standard errors: 0.004
    assert abs(t.std().item() - std) < 0.003
    qs = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64)
    expected = torch.tensor([t_quantile(q) for q in qs.tolist()], dtype=torch.float64)
    assert (t[(qs * n).long()] - expected).abs().max() < 0.006, (t[(qs * n).long()], expected)
    ks = (torch.arange(1, n + 1, dtype=torch.float64) / n - t_cdf(t)).abs().max().item()
    assert ks < 1.63 / math.sqrt(n)  # Kolmogorov-Smirnov at the 1% level: 0.005
    assert t[0] > (S - 1.0) / S and t[-1] <= 1.0


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig(name="groot", size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM,
                                   max_token_len=96))


def _sample_with_field(model, field, noise):
    """sample_actions with the network's velocity replaced by field(x, t), t = bucket / 1000."""
    g = torch.Generator().manual_seed(0)
    batch = collate([GrootSample(images=torch.rand(1, 3, 32, 32, generator=g), text_ids=[5, 6, 7],
                                 state=torch.zeros(64)) for _ in range(noise.shape[0])], embodiment_id=31)
    velocity = model.action_head.velocity
    model.action_head.velocity = lambda context, state, x, timestep, *rest: field(x, timestep[:, None, None] / 1000)
    try:
        return model.sample_actions(batch, noise=noise, num_steps=4)
    finally:
        model.action_head.velocity = velocity


def test_euler_integrates_from_noise_at_t0_to_the_data_at_t1(model):
    noise = torch.randn(2, HORIZON, ACTION_DIM, generator=torch.Generator().manual_seed(1))
    c = torch.linspace(-1.0, 1.0, ACTION_DIM)
    # dx/dt = c: x(1) = x(0) + c exactly, whatever the step count
    torch.testing.assert_close(_sample_with_field(model, lambda x, t: c.expand_as(x), noise), noise + c)
    # dx/dt = t: the left-point rule at t = 0, 1/4, 1/2, 3/4 adds (0 + 1/4 + 1/2 + 3/4) / 4 = 3/8
    torch.testing.assert_close(_sample_with_field(model, lambda x, t: t.expand_as(x), noise), noise + 0.375)
    # dx/dt = -x: each step multiplies by (1 - 1/4), so the field is read at the current x
    torch.testing.assert_close(_sample_with_field(model, lambda x, t: -x, noise), noise * 0.75 ** 4)


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + eps)


def test_adaln_is_layernorm_times_one_plus_scale_plus_shift_with_scale_first():
    """diffusers-style AdaLayerNorm of GR00T's DiT blocks (norm1.linear): linear(silu(temb)) = [scale | shift]."""
    torch.manual_seed(0)
    width = 8
    norm = AdaLayerNorm(width)
    x, temb = torch.randn(3, 5, width), torch.randn(3, width)
    out = norm(x, temb)
    w, b = norm.linear.weight, norm.linear.bias  # [2D, D]: rows 0..D-1 give scale, D..2D-1 shift
    scale = F.silu(temb) @ w[:width].T + b[:width]
    shift = F.silu(temb) @ w[width:].T + b[width:]
    expected = _layer_norm(x, 1e-5) * (1 + scale[:, None]) + shift[:, None]
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_the_dit_output_modulation_is_shift_first():
    """The DiT's output (proj_out_1, a different layout from the blocks' AdaLN): [shift | scale], LayerNorm eps 1e-6,
    then proj_out_2. Checked on a DiT without blocks."""
    tiny = shape_for("tiny")
    shape = GrootShape(tiny.vision, tiny.llm, tiny.head.__class__(**{**tiny.head.__dict__, "dit_depth": 0}))
    torch.manual_seed(0)
    dit = DiT(shape)
    width = shape.head.dit_width
    x, timestep = torch.randn(2, 7, width), torch.tensor([120.0, 860.0])
    with torch.no_grad():
        out = dit(x, None, timestep, None)
        c = F.silu(dit.timestep_encoder(timestep))
        w, b = dit.proj_out_1.weight, dit.proj_out_1.bias
        shift, scale = c @ w[:width].T + b[:width], c @ w[width:].T + b[width:]
        expected = dit.proj_out_2(_layer_norm(x, 1e-6) * (1 + scale[:, None]) + shift[:, None])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
