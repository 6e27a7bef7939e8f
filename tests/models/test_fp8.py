"""precision: fp8. torchao trains on CPU here (the tiny model, a few steps); transformer-engine only in `gpu` tests.

On CPU, torch 2.13's _scaled_mm for e4m3 x e4m3 with tensor-wise scales (the forward matmuls of torchao's
"current" recipe) runs ~5M multiply-adds/s (measured), while the backward's e5m2 x e4m3 ones are fast: the
training test keeps the forward tiny (one sample, one camera, a short prompt) and runs 5 steps (~10 s).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from embodyhpc.config.schema import ModelConfig, PrecisionConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_model, build_tokenizer
from embodyhpc.models.fp8 import convert_to_fp8, count_fp8_linears, fp8_autocast, fp8_linear_filter
from embodyhpc.models.pi05 import Pi05Sample, collate
from tests.helpers import require

require("torchao", "fp8")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

FP8 = PrecisionConfig(mode="fp8", fp8_backend="torchao", fp8_recipe="current")
# After 5 identical steps (same init, data, noise and times) fp8's loss stays within 5% of fp32's: float8
# rounding perturbs every step by ~1% on this model (measured 0.3-1.4%), the trajectory stays the same.
LOSS_RTOL_AFTER_5_STEPS = 0.05


def converted_names(model: nn.Module) -> set[str]:
    return {name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}


def test_the_filter_rule_on_the_tiny_model(tiny_cfg) -> None:
    model = build_model(tiny_cfg, FP8)
    converted = converted_names(model)
    block_linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)
                     and name.startswith(("vision.blocks.", "layers.")) and "norm" not in name}
    # 2 vision blocks x 6 Linear, 2 layers x 2 streams x 7, less the last layer's VLM q/o/gate/up/down (k/v only)
    assert converted == block_linears and len(converted) == 2 * 6 + 2 * 2 * 7 - 5
    kept = {name for name, module in model.named_modules() if isinstance(module, nn.Linear)} - converted
    assert {"vision_projector", "action_in", "action_out", "time_mlp_in", "time_mlp_out",
            "final_norm.modulation", "layers.0.expert.attn_norm.modulation"} <= kept
    assert count_fp8_linears(model) == (len(converted), len(kept))


def test_layers_whose_dims_are_not_multiples_of_16_stay_high_precision() -> None:
    assert fp8_linear_filter(nn.Linear(128, 256), "layers.3.vlm.mlp.gate_proj")
    assert not fp8_linear_filter(nn.Linear(24, 256), "layers.3.vlm.mlp.gate_proj")
    assert not fp8_linear_filter(nn.Linear(128, 1000), "vision.blocks.0.fc1")
    assert not fp8_linear_filter(nn.Linear(128, 256), "action_out")
    assert not fp8_linear_filter(nn.Linear(128, 256), "layers.0.expert.mlp_norm.modulation")


@pytest.mark.slow
def test_fp8_trains_like_fp32_on_cpu(tiny_cfg) -> None:
    g = torch.Generator().manual_seed(0)
    sample = Pi05Sample(images=torch.rand(1, 3, 32, 32, generator=g), instruction="go",
                        state=torch.rand(2, generator=g) * 2 - 1, actions=torch.randn(8, 8, generator=g))
    batch = collate([sample], build_tokenizer(tiny_cfg), max_prompt_tokens=64)
    noise, time = torch.randn(1, 8, 8, generator=g), torch.rand(1, generator=g)
    curves = {}
    for mode in ("fp32", "fp8"):
        torch.manual_seed(0)
        model = build_model(tiny_cfg, dataclasses.replace(FP8, mode=mode))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        curves[mode] = []
        for _ in range(5):
            loss = model(batch, noise=noise, time=time).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curves[mode].append(loss.item())
    assert converted_names(model)  # the fp8 run really ran Float8Linear layers
    assert curves["fp8"][-1] < curves["fp8"][0] * 0.85, curves
    assert curves["fp8"][-1] == pytest.approx(curves["fp32"][-1], rel=LOSS_RTOL_AFTER_5_STEPS), curves


def test_meta_build_with_fp8_materialises(tiny_cfg) -> None:
    with torch.device("meta"):
        model = build_model(tiny_cfg, FP8)
    model.to_empty(device="cpu")
    model.init_weights()
    assert converted_names(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_recipes_torchao_lacks_are_refused(tiny_cfg) -> None:
    for recipe in ("delayed", "block"):
        with pytest.raises(ConfigError, match=f"precision.fp8_recipe: fp8_recipe={recipe} is not available"):
            build_model(tiny_cfg, dataclasses.replace(FP8, fp8_recipe=recipe))


def test_the_fp8_context_changes_nothing_unless_the_backend_is_te(monkeypatch) -> None:
    """fp8_autocast opens te.autocast only for fp8 with te: with no precision section, bf16, or fp8 with torchao
    (whose Float8Linear scales by itself) it never reaches transformer-engine, leaves torch's autocast state as it
    was, and the model computes inside it exactly what it computes outside, in the same dtype."""
    from embodyhpc.models import fp8 as fp8_module

    def no_te():
        raise AssertionError("fp8_autocast reached transformer-engine")

    monkeypatch.setattr(fp8_module, "import_te", no_te)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).to(torch.bfloat16)
    converted = _convert_torchao_all(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)))
    assert count_fp8_linears(converted) == (2, 0)
    x = torch.randn(16, 32)
    for model, inputs in ((plain, x.to(torch.bfloat16)), (converted, x)):
        expected = model(inputs)
        for cfg in (None, PrecisionConfig(mode="bf16"), FP8):
            autocast_state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
            with fp8_autocast(cfg):
                assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == autocast_state
                out = model(inputs)
            assert out.dtype == expected.dtype == inputs.dtype and torch.equal(out, expected), cfg
    with pytest.raises(AssertionError, match="reached transformer-engine"):  # the te case does reach it
        fp8_autocast(dataclasses.replace(FP8, fp8_backend="te"))


def _convert_torchao_all(model: nn.Module) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(model, config=Float8LinearConfig())


def te_available() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(te_available(), reason="transformer-engine is installed")
def test_te_backend_without_transformer_engine_says_how_to_fix(tiny_cfg) -> None:
    with pytest.raises(ConfigError, match="precision.fp8_backend: .*needs transformer-engine.*fix: pip install"):
        build_model(tiny_cfg, dataclasses.replace(FP8, fp8_backend="te"))


@pytest.mark.gpu  # without a GPU it skips; with one, a missing transformer-engine fails it (tests/conftest.py)
@pytest.mark.parametrize("recipe", ["current", "delayed", "block"])
def test_te_backend_trains_on_gpu(recipe: str) -> None:
    from tests.models.conftest import make_batch, make_samples

    require("transformer_engine.pytorch", "gpu")

    # dims of every converted layer must suit te's fp8 GEMMs; tiny's (64..256) do
    cfg = ModelConfig(size="tiny", action_horizon=16, action_dim=16, max_token_len=160)
    precision = PrecisionConfig(mode="fp8", fp8_backend="te", fp8_recipe=recipe)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = build_model(cfg, PrecisionConfig(mode="fp32"))
    convert_to_fp8(model, precision)
    assert count_fp8_linears(model)[0] > 0
    samples = [dataclasses.replace(s, actions=torch.randn(16, 16)) for s in make_samples(8)]
    batch = make_batch(cfg, samples).to("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        with fp8_autocast(precision):
            loss = model(batch, generator=torch.Generator("cuda").manual_seed(0)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
