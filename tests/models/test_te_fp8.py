"""precision.fp8_backend=te on the CPU, through the transformer-engine double of tests/doubles (transformer-engine
2.9-2.18's API: te.Linear's device and init semantics, autocast, distributed.checkpoint, the FP8 shape rule).

What runs here is our code around the library, the same code a GPU node runs: the conversion of the filtered
Linear layers, the meta-device build, initialisation, the FP8 context of the forward, the FP8 GEMM counter, the
version gate and the vision tower's token alignment. The training-loop side (autocast in every micro-batch, the
recompute under activation checkpointing, the logged GEMM counts) is in tests/train/test_loop_te.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from embodyhpc.config.schema import PrecisionConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_model
from embodyhpc.models.fp8 import FP8GemmCounter, count_fp8_linears, fp8_autocast
from embodyhpc.models.pi05.shapes import shape_for
from embodyhpc.models.vision import VisionTower
from embodyhpc.parallel import materialize
from tests.models.conftest import make_batch, make_samples

TE = PrecisionConfig(mode="fp8", fp8_backend="te", fp8_recipe="current")
TORCHAO = PrecisionConfig(mode="fp8", fp8_backend="torchao", fp8_recipe="current")


def te_linears(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__module__.startswith("transformer_engine")]


def test_a_meta_build_keeps_te_layers_on_meta(te_double, tiny_cfg) -> None:
    """TE defers initialisation only for device == "meta" (a string comparison): given torch.device("meta") it
    would allocate and initialise every weight on cuda at build time (the double raises where TE would go to cuda)."""
    with torch.device("meta"):
        model = build_model(tiny_cfg, TE)
    layers = te_linears(model)
    assert len(layers) == count_fp8_linears(model)[0] > 0
    assert all(p.is_meta for layer in layers for p in layer.parameters())


def test_a_real_build_copies_the_linear_values_into_te_layers(te_double, tiny_cfg) -> None:
    torch.manual_seed(0)
    reference = build_model(tiny_cfg)
    torch.manual_seed(0)
    converted = build_model(tiny_cfg, TE)
    for name, module in converted.named_modules():
        if module in te_linears(converted):
            assert torch.equal(module.weight, reference.get_submodule(name).weight), name


def _nan_canary_materialize(model: nn.Module) -> None:
    """materialize, with every allocated parameter filled with NaN first (what uninitialised memory may hold)."""
    to_empty = model.to_empty

    def poisoned(*, device, recurse=True):
        result = to_empty(device=device, recurse=recurse)
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan"))
        return result

    model.to_empty = poisoned
    materialize(model, "cpu", seed=1)


@pytest.mark.parametrize("variant", ["te", "torchao", "expert_state"])
def test_every_parameter_of_every_module_type_is_initialised(te_double, tiny_cfg, variant) -> None:
    """NaN canary: nothing survives materialize, whatever layer types the model holds (te.Linear is not an
    nn.Linear; torchao's Float8Linear is; the expert-state projection exists only with state_input=expert)."""
    cfg, precision = tiny_cfg, {"te": TE, "torchao": TORCHAO}.get(variant)
    if variant == "expert_state":
        cfg = dataclasses.replace(tiny_cfg, state_input="expert", state_dim=6)
    with torch.device("meta"):
        model = build_model(cfg, precision)
    _nan_canary_materialize(model)
    bad = [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]
    assert not bad
    if variant == "te":  # te layers got the rule of every Linear (normal, std 0.02), not TE's own default (0.023)
        weights = torch.cat([layer.weight.flatten() for layer in te_linears(model)])
        assert weights.std().item() == pytest.approx(0.02, rel=0.05)


def test_a_parameter_without_an_init_rule_is_refused(tiny_cfg) -> None:
    with torch.device("meta"):
        model = build_model(tiny_cfg)
    model.layers[0].extra = nn.Parameter(torch.empty(3))
    with pytest.raises(TypeError, match="no init rule for parameter 'layers.0.extra'"):
        materialize(model, "cpu", seed=0)


def test_the_adarms_gate_starts_at_one_and_scale_and_shift_at_zero(tiny_cfg) -> None:
    with torch.device("meta"):
        model = build_model(tiny_cfg)
    materialize(model, "cpu", seed=0)
    norm = model.layers[0].expert.attn_norm
    dim = norm.dim
    assert torch.equal(norm.modulation.bias[2 * dim:], torch.ones(dim))
    assert torch.equal(norm.modulation.bias[:2 * dim], torch.zeros(2 * dim))
    assert torch.equal(model.final_norm.modulation.bias, torch.zeros(2 * model.final_norm.dim))


def test_te_layers_run_in_fp8_only_inside_autocast_and_the_counter_sees_it(te_double, tiny_cfg) -> None:
    torch.manual_seed(0)
    model = build_model(tiny_cfg, TE)
    counter = FP8GemmCounter(model, "cpu")
    batch = make_batch(tiny_cfg, make_samples(2))
    model(batch).loss.backward()
    assert counter.take() == (0, counter.num_layers)  # outside autocast: every te layer fell back
    with fp8_autocast(TE):
        loss = model(batch).loss
    loss.backward()
    assert counter.take() == (counter.num_layers, 0)
    assert all(layer.fp8_forwards == 1 and layer.high_precision_forwards == 1 for layer in te_linears(model))


def test_autocast_uses_the_recipe_of_the_precision_section(te_double) -> None:
    from transformer_engine.common import recipe
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    expected = {"current": recipe.Float8CurrentScaling, "delayed": recipe.DelayedScaling,
                "block": recipe.Float8BlockScaling}
    for name, kind in expected.items():
        with fp8_autocast(dataclasses.replace(TE, fp8_recipe=name), amax_reduction_group="dp"):
            assert FP8GlobalStateManager.is_fp8_enabled()
            assert type(FP8GlobalStateManager.get_fp8_recipe()) is kind
            assert FP8GlobalStateManager.get_fp8_group() == "dp"
        assert not FP8GlobalStateManager.is_fp8_enabled()


@pytest.mark.parametrize("version", ["2.8.1", "1.13.0"])
def test_a_transformer_engine_older_than_2_9_is_refused_in_one_line(te_double, tiny_cfg, monkeypatch,
                                                                    version) -> None:
    monkeypatch.setattr(te_double, "__version__", version)
    with pytest.raises(ConfigError, match=rf"precision.fp8_backend: transformer-engine {version} is too old.*"
                                          r"fix: pip install 'transformer-engine\[pytorch\]>=2.9"):
        build_model(tiny_cfg, TE)


def test_the_small_vision_tower_feeds_fp8_gemms_token_counts_they_accept(te_double) -> None:
    """small has 196 patches per image: one image is 196 tokens, which FP8 GEMMs refuse (TE: a multiple of 8;
    torchao's backward: 16). The tower pads the images to a multiple of image_group (4) and drops the padding."""
    vision = dataclasses.replace(shape_for("small").vision, depth=1)
    tower = VisionTower(vision)
    nn.init.normal_(tower.position_embedding, std=0.02)
    from embodyhpc.models.fp8 import convert_te

    reference = VisionTower(vision)
    reference.load_state_dict(tower.state_dict())
    convert_te(_Prefixed(tower))
    assert te_linears(tower)
    images = torch.rand(3, 3, 224, 224)
    with fp8_autocast(TE):
        out = tower(images)
    assert out.shape == (3, 196, vision.width)
    assert all(layer.fp8_forwards == 1 for layer in te_linears(tower))
    with torch.no_grad():
        expected = reference(images)
        torch.testing.assert_close(tower(images), expected)  # outside autocast: the padding changes nothing
        assert (out - expected).abs().mean() < 0.05 * expected.abs().mean()  # fp8 rounding only


class _Prefixed(nn.Module):
    """A tower at the `vision.` prefix, where the fp8 filter looks for vision blocks."""

    def __init__(self, tower: VisionTower) -> None:
        super().__init__()
        self.vision = tower
