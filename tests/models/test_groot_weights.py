"""GR00T's published-weights adapter on the tiny size: round trips, the sliced loader of model.init_weights, and
the one-line refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors import safe_open

from embodyhpc.checkpoint.sliced_weights import load_init_weights
from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model
from embodyhpc.models.groot.weights import ADAPTER, LM_HEAD, load_groot_weights, save_groot_weights, to_published
from embodyhpc.models.weights_io import WeightsLayoutError

CFG = ModelConfig(name="groot", size="tiny", action_horizon=16, action_dim=4, max_token_len=96)


def model(seed: int, cfg: ModelConfig = CFG):
    torch.manual_seed(seed)
    built = build_model(cfg)
    built.init_weights(seed=seed)
    return built


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    source = model(1)
    path = save_groot_weights(source, tmp_path_factory.mktemp("groot") / "published")
    return source, path


def _equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_published_file_loads_back_exactly(published):
    source, path = published
    with safe_open(str(path), "pt") as saved:  # the family's layout name (the adapter is shared by the families)
        assert saved.metadata()["layout"] == "nvidia-gr00t-n1.5"
    target = model(2)
    assert not _equal(source, target)
    report = load_groot_weights(target, path)
    assert _equal(source, target) and report.ok
    assert LM_HEAD in report.ignored and any(".head.probe" in k for k in report.ignored)
    with torch.device("meta"):
        meta = build_model(CFG)
    load_groot_weights(meta, path)  # a meta model gets the tensors assigned
    assert _equal(source, meta)


def test_the_tied_lm_head_is_written_as_a_copy_of_the_embedding(published):
    source, _ = published
    out = to_published(source.state_dict(), source.shape)
    assert torch.equal(out[LM_HEAD], out["backbone.eagle_model.language_model.model.embed_tokens.weight"])
    assert "backbone.eagle_model.mlp1.0.weight" in out and "action_head.future_tokens.weight" in out


def test_model_init_weights_reads_it_through_the_sliced_loader(published):
    source, path = published
    target = model(3)
    report = load_init_weights(target, path, ADAPTER)
    assert _equal(source, target) and len(report.loaded) == len(dict(target.named_parameters()))


def test_a_prefixed_state_dict_loads_and_reports_its_prefix(published):
    source, _ = published
    prefixed = {f"_groot_model.{k}": v for k, v in to_published(source.state_dict(), source.shape).items()}
    target = model(4)
    report = load_groot_weights(target, prefixed)
    assert report.key_prefix == "_groot_model." and _equal(source, target)


def _published(**drop_or_add) -> dict[str, torch.Tensor]:
    return to_published(model(5).state_dict(), model(5).shape)


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: {"paligemma_with_expert.paligemma.lm_head.weight": torch.zeros(2)},
     r"is a pi0.5/pi0 checkpoint \(paligemma_with_expert.\*\), not GR00T: set model.name=pi05"),
    (lambda d: {"layers.0.weight": torch.zeros(2)}, r"holds no GR00T tensors"),
    (lambda d: {k: v for k, v in d.items() if not k.startswith("action_head.vlln.")},
     r"is a GR00T-N1 checkpoint \(no action_head.vlln\)"),
    (lambda d: {k: v for k, v in d.items() if k != "action_head.future_tokens.weight"},
     r"missing 1 key\(s\): action_head.future_tokens.weight \(strict=False loads the rest\)"),
    (lambda d: d | {"action_head.extra.weight": torch.zeros(3)}, r"unexpected 1 key\(s\): action_head.extra.weight"),
])
def test_foreign_or_incomplete_checkpoints_are_refused_in_one_line(edit, match):
    with pytest.raises(WeightsLayoutError, match=match) as caught:
        load_groot_weights(model(6), edit(_published()))
    assert "\n" not in str(caught.value)


def test_another_action_dim_is_refused_with_the_recipe_key():
    other = dataclasses.replace(CFG, action_dim=8)
    width = model(7).shape.head.dit_width
    with pytest.raises(WeightsLayoutError, match=rf"action_head.action_encoder.W1.W: model \[32, 4, {width}\] vs "
                                                 rf"checkpoint \[32, 8, {width}\] \(set model.action_dim") as caught:
        load_groot_weights(model(7), to_published(model(7, other).state_dict(), model(7).shape))
    assert "\n" not in str(caught.value)


def test_non_strict_loads_what_is_there(published):
    source, _ = published
    partial = {k: v for k, v in to_published(source.state_dict(), source.shape).items()
               if not k.startswith("action_head.model.proj_out")}
    target = model(8)
    report = load_groot_weights(target, partial, strict=False)
    assert sorted(report.missing) == [f"action_head.model.proj_out_{i}.{p}" for i in (1, 2) for p in ("bias", "weight")]
    assert torch.equal(target.action_head.vlln.weight, source.action_head.vlln.weight)


def test_a_damaged_file_is_refused_by_the_sliced_loader(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(WeightsLayoutError, match="not a readable safetensors checkpoint"):
        load_init_weights(model(9), bad, ADAPTER)
