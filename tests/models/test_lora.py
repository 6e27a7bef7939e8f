"""LoRA (models/lora.py, model.lora) on both families, against formulas written here:

- the adapted layer computes x W^T + b + (alpha / r) x A^T B^T (einsum here), its merge holds W + (alpha / r) B A;
- B starts at zero: the adapted model's step-0 loss and actions equal the base model's bit for bit;
- the base is frozen: only the adapters get gradients and AdamW state (counted: 2 moments x 4 bytes x adapter params);
- the moving average covers the adapters only;
- merged weights (a plain model, no adapters) act exactly like the adapted model: max abs difference of the actions;
- targets: presets expand to the layers named here by hand; a target matching nothing or no nn.Linear is refused.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from embodyhpc.config.lora_schema import LoraConfig
from embodyhpc.config.schema import ModelConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_model
from embodyhpc.models.lora import LoRALinear, lora_layers, merge_lora, merge_lora_state
from embodyhpc.train.ema import ParameterEMA
from embodyhpc.train.optim import build_optimizer
from tests.models import test_groot
from tests.models.conftest import make_batch, make_samples

PI05 = ModelConfig(size="tiny", action_horizon=8, action_dim=8, max_token_len=160)
GROOT = ModelConfig(name="groot", size="tiny", action_horizon=test_groot.HORIZON, action_dim=test_groot.ACTION_DIM,
                    max_token_len=96)
LORA = LoraConfig(rank=4, alpha=8.0)  # scale 2: a merge that forgets the scale, or squares it, is visible


def _built(cfg: ModelConfig, lora: LoraConfig | None = LORA, seed: int = 0):
    torch.manual_seed(seed)
    return build_model(dataclasses.replace(cfg, lora=lora or LoraConfig()))


def _batch(cfg: ModelConfig):
    return make_batch(cfg, make_samples(3)) if cfg.name == "pi05" else test_groot.make_batch(3)


def _trained_adapters(model, seed: int = 1) -> None:
    """B away from zero, as training leaves it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=g) * 0.05)


def _actions(model, batch, cfg) -> torch.Tensor:
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.eval().sample_actions(batch, noise=noise)


def test_the_layer_and_its_merge_follow_the_lora_formula():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    layer = LoRALinear.wrap(base, rank=3, scale=2.5)
    with torch.no_grad():
        layer.lora_A.normal_()
        layer.lora_B.normal_()
    x = torch.randn(4, 6)
    W, b, A, B = base.weight, base.bias, layer.lora_A, layer.lora_B
    want = torch.einsum("ni,oi->no", x, W) + b + 2.5 * torch.einsum("ni,ri,or->no", x, A, B)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
    merged = layer.merged()
    assert type(merged) is torch.nn.Linear
    torch.testing.assert_close(merged.weight, W + 2.5 * torch.einsum("or,ri->oi", B, A), rtol=1e-6, atol=1e-6)
    state = merge_lora_state({"l.weight": W, "l.bias": b, "l.lora_A": A, "l.lora_B": B}, 2.5)
    assert set(state) == {"l.weight", "l.bias"}
    torch.testing.assert_close(state["l.weight"], merged.weight, rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [PI05, GROOT], ids=["pi05", "groot"])
def test_step_zero_is_the_base_model_and_only_adapters_train(cfg):
    base, adapted = _built(cfg, None), _built(cfg)
    batch = _batch(cfg)
    # B = 0: the same loss (fixed noise and time) and the same actions as the base model, exactly
    noise = torch.randn(3, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(2))
    time = torch.full((3,), 0.4)
    assert torch.equal(base(batch, noise=noise, time=time).loss, adapted(batch, noise=noise, time=time).loss)
    assert torch.equal(_actions(base, batch, cfg), _actions(adapted, batch, cfg))

    adapted.train()
    layers = lora_layers(adapted)
    adapter_params = [p for layer in layers.values() for p in (layer.lora_A, layer.lora_B)]
    assert all(p.requires_grad for p in adapter_params)
    trainable = {name for name, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == {f"{name}.{ab}" for name in layers for ab in ("lora_A", "lora_B")}
    optimizer = build_optimizer(adapted, lr=1e-2, weight_decay=0.01)
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {id(p) for p in adapter_params}
    frozen = {name: p.detach().clone() for name, p in adapted.named_parameters() if not p.requires_grad}
    adapted(batch).loss.backward()
    optimizer.step()
    # AdamW state for the adapters only: exp_avg and exp_avg_sq (fp32) per adapter parameter, nothing for the base
    state = optimizer.state
    assert {id(p) for p in state} == {id(p) for p in adapter_params}
    moments = sum(t.numel() * t.element_size() for s in state.values() for k, t in s.items() if k != "step")
    assert moments == 2 * 4 * sum(p.numel() for p in adapter_params)
    assert all(torch.equal(p, frozen[name]) for name, p in adapted.named_parameters() if name in frozen)
    assert any(layer.lora_B.abs().sum() > 0 for layer in layers.values()), "the adapters learned nothing"
    # the moving average follows what trains: the adapters, nothing of the frozen base
    ema = ParameterEMA(adapted, 0.9)
    assert set(ema.state_dict()) == trainable


@pytest.mark.parametrize("cfg", [PI05, GROOT], ids=["pi05", "groot"])
def test_merged_weights_act_like_the_adapted_model(cfg, record_property):
    adapted = _built(cfg)
    _trained_adapters(adapted)
    batch = _batch(cfg)
    want = _actions(adapted, batch, cfg)
    plain = _built(cfg, None, seed=7)  # other initial values: everything must come from the merged state
    plain.load_state_dict(merge_lora_state(adapted.state_dict(), LORA.scale), strict=True)
    got = _actions(plain, batch, cfg)
    diff = float((got - want).abs().max())
    record_property("max_abs_diff", diff)
    print(f"{cfg.name}: merged vs adapted actions, max abs difference {diff:.3g}")
    assert diff < 1e-5
    base = _actions(_built(cfg, None), batch, cfg)
    assert float((want - base).abs().max()) > 1e-3, "the adapters change nothing: the comparison proves nothing"
    merge_lora(adapted)
    assert not lora_layers(adapted) and set(adapted.state_dict()) == set(plain.state_dict())
    assert float((_actions(adapted, batch, cfg) - want).abs().max()) < 1e-5


def test_presets_name_the_layers_openpi_and_gr00t_adapt():
    # openpi's gemma_2b_lora / gemma_300m_lora: every attention and MLP projection of the two transformers
    block = re.compile(r"layers\.\d+\.(vlm|expert)\.([qkvo]_proj|mlp\.(gate|up|down)_proj)")
    linears = [n for n, m in _built(PI05, None).named_modules() if type(m) is torch.nn.Linear]
    want = {n for n in linears if block.fullmatch(n)}
    assert {"layers.0.vlm.q_proj", "layers.0.vlm.mlp.down_proj", "layers.1.expert.o_proj"} <= want
    assert set(lora_layers(_built(PI05))) == want
    only_expert = _built(PI05, dataclasses.replace(LORA, targets=["expert", "layers.0.vlm.q_proj"]))
    assert set(lora_layers(only_expert)) == {n for n in want if ".expert." in n} | {"layers.0.vlm.q_proj"}
    groot = set(lora_layers(_built(GROOT)))
    assert groot and all(n.startswith("action_head.") and n.rsplit(".", 1)[1] in ("to_q", "to_k", "to_v")
                         for n in groot)
    assert len(groot) == 3 * sum(1 for n, _ in _built(GROOT, None).named_modules() if n.endswith(".attn1"))


@pytest.mark.parametrize("targets, match", [
    (["nope"], r"model\.lora\.targets\[0\]: 'nope' matches no layer"),
    (["vlm", "layers.*.vlm"], r"model\.lora\.targets\[1\]: 'layers\.\*\.vlm' matches 'layers\.0\.vlm', a StreamBlock"),
    (["final_norm"], r"model\.lora\.targets\[0\]: 'final_norm' matches 'final_norm', a AdaRMSNorm"),
])
def test_targets_that_adapt_nothing_are_refused_in_one_line(targets, match):
    with pytest.raises(ConfigError, match=match) as info:
        _built(PI05, dataclasses.replace(LORA, targets=targets))
    assert "\n" not in info.value.one_line()


@pytest.mark.parametrize("lora, key", [
    (dict(rank=0), "model.lora.rank"), (dict(rank=-2), "model.lora.rank"),
    (dict(rank=4, alpha=0.0), "model.lora.alpha"),
    (dict(rank=4, dropout=1.0), "model.lora.dropout"), (dict(targets=["vlm"]), "model.lora.rank"),
])
def test_bad_lora_settings_are_refused_naming_the_key(lora, key):
    with pytest.raises(ConfigError) as info:
        LoraConfig(**lora)
    assert info.value.key == key and info.value.fix


def test_the_meta_build_materialized_by_parallel_starts_at_the_base_model():
    """The training path: built on meta, filled by the init rules (parallel/'s materialize): B zero, A a normal draw of
    std 1/sqrt(in_features), and every base parameter equal to the base model's (seeded by its name only)."""
    from embodyhpc.parallel import materialize

    models = {}
    for run, lora in (("base", None), ("lora", LORA)):
        with torch.device("meta"):
            models[run] = build_model(dataclasses.replace(PI05, lora=lora or LoraConfig()))
        materialize(models[run], "cpu", seed=11)
    base, adapted = models["base"].state_dict(), models["lora"].state_dict()
    assert all(torch.equal(adapted[k], v) for k, v in base.items())
    layers = lora_layers(models["lora"])
    assert all(torch.count_nonzero(layer.lora_B) == 0 for layer in layers.values())
    a = torch.cat([(layer.lora_A * layer.in_features ** 0.5).flatten() for layer in layers.values()])
    assert abs(float(a.std()) - 1.0) < 0.05 and abs(float(a.mean())) < 0.05
    batch = _batch(PI05)
    noise = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(2))
    time = torch.full((3,), 0.4)
    assert torch.equal(models["base"](batch, noise=noise, time=time).loss,
                       models["lora"](batch, noise=noise, time=time).loss)


def test_validate_refuses_lora_with_fp8_and_targets_that_match_nothing():
    from embodyhpc.config.schema import Config, DataConfig, PrecisionConfig
    from embodyhpc.validation.lora_checks import check_lora

    data = DataConfig(format="synthetic")
    check_lora(Config(model=dataclasses.replace(PI05, lora=LORA), data=data))  # the presets: fine
    with pytest.raises(ConfigError, match="precision.mode=fp8") as info:
        check_lora(Config(model=dataclasses.replace(PI05, lora=LORA), data=data,
                          precision=PrecisionConfig(mode="fp8")))
    assert info.value.key == "model.lora.rank" and "precision.mode=bf16" in info.value.fix
    with pytest.raises(ConfigError, match="matches no layer") as info:
        check_lora(Config(model=dataclasses.replace(GROOT, lora=dataclasses.replace(LORA, targets=["vlm"])),
                          data=data))
    assert info.value.key == "model.lora.targets[0]" and "action_head" in info.value.fix


@pytest.mark.parametrize("cfg", [PI05, GROOT], ids=["pi05", "groot"])
def test_init_weights_of_a_base_export_load_into_the_adapted_model(cfg, tmp_path):
    """model.init_weights with model.lora (fine-tuning from an export, the main use): the base checkpoint has no
    adapter tensors, so the strict load takes every base tensor and leaves the adapters at their init; the adapted
    model then acts exactly like the base model it was loaded from (B = 0)."""
    from safetensors.torch import save_file

    from embodyhpc.checkpoint.sliced_weights import load_init_weights

    base = _built(cfg, None, seed=5)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in base.state_dict().items() if not k.endswith("_extra_state")}, str(path))
    adapted = _built(cfg, seed=6)  # other base weights until the load
    report = load_init_weights(adapted, path, None)
    assert report.ok and not report.missing, report
    batch = _batch(cfg)
    assert torch.equal(_actions(base, batch, cfg), _actions(adapted, batch, cfg))
    assert all(torch.equal(layer.lora_B, torch.zeros_like(layer.lora_B)) for layer in lora_layers(adapted).values())
