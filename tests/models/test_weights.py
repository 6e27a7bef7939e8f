"""The pi0.5 weights adapter: our state dict <-> the published (openpi / LeRobot PyTorch) safetensors layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model
from embodyhpc.models.pi05.weights import (
    WeightsLayoutError,
    load_pi05_weights,
    published_shapes,
    save_pi05_weights,
    to_published,
)
from tests.helpers import require
from tests.models.conftest import ACTION_DIM, HORIZON

V = "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
L = "paligemma_with_expert.paligemma.model.language_model."
E = "paligemma_with_expert.gemma_expert.model."


def randomized(size: str, seed: int, dtype: torch.dtype = torch.float32):
    """A model whose every tensor holds distinct random values (init leaves norms and modulations constant, which
    would hide a swapped or dropped tensor)."""
    with torch.device("meta"):
        model = build_model(ModelConfig(size=size, action_horizon=HORIZON, action_dim=ACTION_DIM))
    model.to_empty(device="cpu").to(dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def zeroed(size: str, dtype: torch.dtype = torch.float32):
    """A model of `size` whose every parameter is 0: a load target (cheaper than drawing random values)."""
    with torch.device("meta"):
        model = build_model(ModelConfig(size=size, action_horizon=HORIZON, action_dim=ACTION_DIM))
    model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def assert_same_tensors(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


def assert_same_files(a, b) -> None:
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys()
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key


def test_tiny_round_trip_through_a_file_is_bit_identical(tmp_path) -> None:
    source = randomized("tiny", seed=1)
    path = save_pi05_weights(source, tmp_path)
    written = load_file(path)
    assert {k: tuple(v.shape) for k, v in written.items()} == published_shapes(source)
    target = randomized("tiny", seed=2)
    lerobot = load_file(save_pi05_weights(source, tmp_path / "lerobot", key_prefix="model."))
    assert set(lerobot) == {"model." + k for k in written}
    with safe_open(str(path), "pt") as saved:  # the family's layout name (the adapter is shared by the families)
        assert saved.metadata()["layout"] == "openpi-pytorch-pi05"
    report = load_pi05_weights(target, tmp_path)
    assert report.ok and not report.missing and len(report.loaded) == len(source.state_dict())
    assert_same_tensors(source, target)
    assert_same_files(path, save_pi05_weights(target, tmp_path / "again"))  # ours -> theirs is exact too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_small_round_trip_is_bit_identical(dtype) -> None:
    source, target = randomized("small", seed=3, dtype=dtype), zeroed("small", dtype=dtype)  # a missed tensor stays 0
    published = to_published(source.state_dict(), source.shape)
    assert {k: tuple(v.shape) for k, v in published.items()} == published_shapes(source)
    load_pi05_weights(target, published)
    assert_same_tensors(source, target)


def test_sharded_index_meta_build_and_dtype_conversion(tmp_path) -> None:
    source = randomized("tiny", seed=5, dtype=torch.bfloat16)
    tensors = load_file(save_pi05_weights(source, tmp_path / "single"))
    keys = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    folder = tmp_path / "sharded"
    folder.mkdir()
    for name, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(folder / name))
    weight_map = {k: name for name, part in shards.items() for k in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with torch.device("meta"):
        target = build_model(ModelConfig(size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM))
    assert load_pi05_weights(target, folder).ok
    assert not any(p.is_meta for p in target.parameters())
    for name, value in target.state_dict().items():  # bf16 file -> the fp32 model: exact (bf16 fits in fp32)
        assert value.dtype == torch.float32 and torch.equal(value, source.state_dict()[name].float()), name


def test_the_full_key_set_and_shapes_are_the_published_ones() -> None:
    """The published pi0.5 architecture (PaliGemma 3B at 224 px + Gemma 300M expert with adaRMS), written out here
    independently of the adapter's rules."""
    expected = {V + "embeddings.patch_embedding.weight": (1152, 3, 14, 14), V + "embeddings.patch_embedding.bias":
                (1152,), V + "embeddings.position_embedding.weight": (256, 1152),
                V + "post_layernorm.weight": (1152,), V + "post_layernorm.bias": (1152,)}
    for i in range(27):
        block = f"{V}encoder.layers.{i}."
        for name in ("layer_norm1", "layer_norm2"):
            expected |= {f"{block}{name}.weight": (1152,), f"{block}{name}.bias": (1152,)}
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            expected |= {f"{block}self_attn.{name}.weight": (1152, 1152), f"{block}self_attn.{name}.bias": (1152,)}
        expected |= {f"{block}mlp.fc1.weight": (4304, 1152), f"{block}mlp.fc1.bias": (4304,),
                     f"{block}mlp.fc2.weight": (1152, 4304), f"{block}mlp.fc2.bias": (1152,)}
    expected |= {"paligemma_with_expert.paligemma.model.multi_modal_projector.linear.weight": (2048, 1152),
                 "paligemma_with_expert.paligemma.model.multi_modal_projector.linear.bias": (2048,),
                 L + "embed_tokens.weight": (257152, 2048), L + "norm.weight": (2048,)}
    for i in range(18):
        vlm, expert = f"{L}layers.{i}.", f"{E}layers.{i}."
        expected |= {vlm + "input_layernorm.weight": (2048,), vlm + "post_attention_layernorm.weight": (2048,),
                     vlm + "self_attn.q_proj.weight": (8 * 256, 2048), vlm + "self_attn.k_proj.weight": (256, 2048),
                     vlm + "self_attn.v_proj.weight": (256, 2048), vlm + "self_attn.o_proj.weight": (2048, 8 * 256),
                     vlm + "mlp.gate_proj.weight": (16384, 2048), vlm + "mlp.up_proj.weight": (16384, 2048),
                     vlm + "mlp.down_proj.weight": (2048, 16384)}
        for norm in ("input_layernorm", "post_attention_layernorm"):  # adaRMS: [scale | shift | gate] from time
            expected |= {f"{expert}{norm}.dense.weight": (3 * 1024, 1024), f"{expert}{norm}.dense.bias": (3 * 1024,)}
        expected |= {expert + "self_attn.q_proj.weight": (8 * 256, 1024),
                     expert + "self_attn.k_proj.weight": (256, 1024), expert + "self_attn.v_proj.weight": (256, 1024),
                     expert + "self_attn.o_proj.weight": (1024, 8 * 256),
                     expert + "mlp.gate_proj.weight": (4096, 1024), expert + "mlp.up_proj.weight": (4096, 1024),
                     expert + "mlp.down_proj.weight": (1024, 4096)}
    expected |= {E + "norm.dense.weight": (3 * 1024, 1024), E + "norm.dense.bias": (3 * 1024,),
                 "action_in_proj.weight": (1024, 32), "action_in_proj.bias": (1024,),
                 "action_out_proj.weight": (32, 1024), "action_out_proj.bias": (32,),
                 "time_mlp_in.weight": (1024, 1024), "time_mlp_in.bias": (1024,),
                 "time_mlp_out.weight": (1024, 1024), "time_mlp_out.bias": (1024,)}
    with torch.device("meta"):
        model = build_model(ModelConfig(size="full", action_horizon=50, action_dim=32))
    assert published_shapes(model) == expected
    # a checkpoint of exactly that layout (meta tensors, no memory) loads into the meta-built model, LeRobot-style
    checkpoint = {"model." + k: torch.empty(s, device="meta") for k, s in expected.items()}
    report = load_pi05_weights(model, checkpoint)
    assert report.ok and report.key_prefix == "model."
    assert len(report.ignored) == 7 and L + "norm.weight" in report.ignored  # VLM final norm + last layer q/o/MLP


@pytest.fixture(scope="module")
def tiny_published() -> dict[str, torch.Tensor]:
    source = randomized("tiny", seed=6)
    return to_published(source.state_dict(), source.shape)


def tiny_target():
    return randomized("tiny", seed=7)


def test_a_missing_key_fails_naming_it(tiny_published) -> None:
    key = f"{E}layers.1.post_attention_layernorm.dense.weight"
    broken = {k: v for k, v in tiny_published.items() if k != key}
    with pytest.raises(WeightsLayoutError, match=r"missing 1 key\(s\): " + key.replace(".", r"\.")):
        load_pi05_weights(tiny_target(), broken)
    model = tiny_target()
    before = model.layers[1].expert.mlp_norm.modulation.weight.clone()
    report = load_pi05_weights(model, broken, strict=False)
    assert report.missing == [key] and not report.ok
    assert torch.equal(model.layers[1].expert.mlp_norm.modulation.weight, before)  # left as it was
    assert torch.equal(model.action_out.weight, tiny_published["action_out_proj.weight"])  # the rest loaded


def test_a_wrong_shape_fails_naming_the_key_and_both_shapes(tiny_published) -> None:
    key = f"{L}layers.0.self_attn.k_proj.weight"
    broken = dict(tiny_published) | {key: torch.zeros(64, 128)}
    with pytest.raises(WeightsLayoutError, match=key.replace(".", r"\.") + r": model \[32, 128\] vs checkpoint"):
        load_pi05_weights(tiny_target(), broken, strict=False)  # shape mismatches fail even when not strict
    broken = dict(tiny_published) | {"action_in_proj.weight": torch.zeros(64, 32)}
    with pytest.raises(WeightsLayoutError, match="action_in_proj.weight.*model.action_dim"):
        load_pi05_weights(tiny_target(), broken)


def test_unexpected_keys_and_pi0_checkpoints_are_refused(tiny_published) -> None:
    with pytest.raises(WeightsLayoutError, match=r"unexpected 1 key\(s\): extra_head\.weight"):
        load_pi05_weights(tiny_target(), dict(tiny_published) | {"extra_head.weight": torch.zeros(2)})
    pi0 = dict(tiny_published) | {"state_proj.weight": torch.zeros(64, 8)}
    with pytest.raises(WeightsLayoutError, match="is a pi0 checkpoint"):
        load_pi05_weights(tiny_target(), pi0, strict=False)


def test_lm_head_stands_in_for_the_tied_embedding_and_old_time_mlp_names(tiny_published) -> None:
    renamed = {}
    for key, value in tiny_published.items():
        key = key.replace(L + "embed_tokens.weight", "paligemma_with_expert.paligemma.lm_head.weight")
        renamed[key.replace("time_mlp_", "action_time_mlp_")] = value
    model = tiny_target()
    assert load_pi05_weights(model, renamed).ok
    assert torch.equal(model.embed_tokens.weight, tiny_published[L + "embed_tokens.weight"])
    assert torch.equal(model.time_mlp_in.weight, tiny_published["time_mlp_in.weight"])


def test_loaded_weights_keep_the_model_function(tiny_cfg, tmp_path) -> None:
    """Through the file and back, the model computes the same velocities (gates, final norm rows included)."""
    from tests.models.conftest import make_batch, make_samples

    source = randomized("tiny", seed=8)
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(0.05)  # keep activations in a sane range
    target = randomized("tiny", seed=9)
    load_pi05_weights(target, save_pi05_weights(source, tmp_path))
    batch = make_batch(tiny_cfg, make_samples(2), rows=[[0, 1]])
    noise, time = torch.randn(2, HORIZON, ACTION_DIM), torch.rand(2)
    with torch.no_grad():
        torch.testing.assert_close(target(batch, noise=noise, time=time).per_sample_loss,
                                   source(batch, noise=noise, time=time).per_sample_loss, rtol=0, atol=0)


def test_fp8_converted_models_save_and_load(tmp_path) -> None:
    """torchao wraps float8-trained weights in a tensor subclass; the files hold plain tensors all the same."""
    require("torchao.float8", "fp8")
    from embodyhpc.config.schema import PrecisionConfig

    cfg = ModelConfig(size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM)
    fp8 = PrecisionConfig(mode="fp8", fp8_backend="torchao", fp8_recipe="current")
    torch.manual_seed(0)
    source = build_model(cfg, fp8)
    torch.manual_seed(1)
    target = build_model(cfg, fp8)
    assert load_pi05_weights(target, save_pi05_weights(source, tmp_path)).ok
    for name, value in source.state_dict().items():
        assert torch.equal(torch.as_tensor(target.state_dict()[name]) * 1, torch.as_tensor(value) * 1), name


def sharded_round_trip(rank: int, world: int, folder: str) -> dict:
    from pathlib import Path

    from embodyhpc.checkpoint.sliced_weights import load_weights_sharded, save_weights_sharded
    from embodyhpc.config.schema import ParallelismConfig
    from embodyhpc.models.pi05.weights import ADAPTER
    from embodyhpc.parallel import build_mesh
    from tests.parallel.workers import build_sharded, local_params

    mesh = build_mesh(1, world, "cpu")
    model, _ = build_sharded(mesh, ParallelismConfig())
    report = load_weights_sharded(model, Path(folder) / "source.safetensors", ADAPTER)
    saved = save_weights_sharded(model, Path(folder) / "resaved.safetensors", ADAPTER)
    errors = []
    try:
        load_weights_sharded(model, Path(folder) / "broken.safetensors", ADAPTER)
    except WeightsLayoutError as exc:
        errors.append(str(exc))
    return {"ok": report.ok, "local": local_params(model), "saved": str(saved), "errors": errors}


def test_fsdp_sharded_load_and_save(tmp_path) -> None:
    from tests.parallel.harness import run_ranks
    from tests.parallel.workers import assemble

    source = randomized("tiny", seed=10)
    save_pi05_weights(source, tmp_path / "source.safetensors")
    broken = load_file(tmp_path / "source.safetensors")
    broken.pop("action_out_proj.bias")
    save_file(broken, str(tmp_path / "broken.safetensors"))
    ranks = run_ranks(sharded_round_trip, 2, str(tmp_path), timeout_s=180)
    assert all(r["ok"] for r in ranks)
    full = assemble([r["local"] for r in ranks])
    for name, value in source.state_dict().items():
        assert torch.equal(full[name], value), name
    assert_same_files(tmp_path / "resaved.safetensors", tmp_path / "source.safetensors")
    assert all(len(r["errors"]) == 1 and "action_out_proj.bias" in r["errors"][0] for r in ranks)
