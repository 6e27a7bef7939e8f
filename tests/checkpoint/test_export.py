"""Export: one safetensors file equal to the full model state dict, loadable strictly into a plain module."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from embodyhpc.checkpoint import NotACheckpointError, consolidated_model_state, export_consolidated, load_exported
from embodyhpc.models import build_model
from tests.checkpoint.distributed import MODEL_CFG
from tests.checkpoint.jobs import CONFIG_YAML


def _expected(saved_on_two_ranks, step):
    return torch.load(saved_on_two_ranks / "expected.pt", weights_only=True)[step]["model"]


def test_export_at_the_end_of_a_two_rank_job_equals_the_full_state_dict(saved_on_two_ranks):
    out = saved_on_two_ranks / "export"
    weights, summary = load_exported(out)
    expected = _expected(saved_on_two_ranks, 3)
    assert weights.keys() == expected.keys()
    for key, tensor in expected.items():
        assert weights[key].dtype == tensor.dtype and torch.equal(weights[key], tensor), key
    assert (out / "config.yaml").read_text() == CONFIG_YAML
    assert summary["step"] == 3 and summary["num_tensors"] == len(expected)
    assert summary["num_parameters"] == sum(t.numel() for t in expected.values())
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["step"] == "3"

    plain = build_model(MODEL_CFG)  # no FSDP, no process group: what evaluation and users load into
    plain.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    for key, tensor in plain.state_dict().items():
        assert torch.equal(tensor, expected[key]), key


def test_export_from_a_folder_offline_with_a_cast(saved_on_two_ranks, tmp_path):
    weights_path = export_consolidated(saved_on_two_ranks / "checkpoints" / "step-2", tmp_path / "bf16",
                                       config_yaml=CONFIG_YAML, dtype=torch.bfloat16)
    weights = load_file(str(weights_path))
    for key, tensor in _expected(saved_on_two_ranks, 2).items():
        assert torch.equal(weights[key], tensor.to(torch.bfloat16)), key
    assert sorted(p.name for p in (tmp_path / "bf16").iterdir()) == ["config.yaml", "export.json",
                                                                      "model.safetensors"]


def test_export_refuses_an_unmarked_folder(tmp_path):
    (tmp_path / "step-9").mkdir()
    with pytest.raises(NotACheckpointError, match="not a complete checkpoint"):
        consolidated_model_state(tmp_path / "step-9")
    with pytest.raises(NotACheckpointError, match="not a finished export"):
        load_exported(tmp_path)
