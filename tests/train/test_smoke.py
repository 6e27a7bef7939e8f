"""`embodyhpc smoke`: on this CPU-only machine the CPU references run and every GPU row is skipped with its reason;
on a GPU node (availability monkeypatched: that is the whole branch) the rows offered follow the install."""

from __future__ import annotations

import json

import pytest
import torch

from embodyhpc.train import smoke
from embodyhpc.train.smoke import SmokePath, plan_rows
from tests.helpers import DOUBLES, drop_modules


@pytest.fixture
def gpu_node(monkeypatch):
    """A node with 4 GPUs as torch would report it (nothing runs on them here: only planning is tested)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H100 80GB HBM3")


def _reasons(rows) -> dict[str, str | None]:
    return {path.name: reason for path, reason in rows}


def test_on_a_gpu_node_without_gpu_libraries_their_rows_say_what_is_missing(gpu_node) -> None:
    rows, device = plan_rows()
    reasons = _reasons(rows)
    assert device == "NVIDIA H100 80GB HBM3 x4"
    assert not any(name.startswith("cpu ") for name in reasons)  # GPU nodes run the GPU paths only
    assert "flash-attn 2 is not installed" in reasons["attention flash_varlen"]
    for recipe in ("current", "delayed", "block"):
        assert "needs transformer-engine" in reasons[f"te fp8 {recipe}"]
    for name in ("attention sdpa_reference", "bf16", "torchao fp8", "compile", "compile + cuda graphs",
                 "fsdp2 x4 gpus", "attention torch_varlen", "attention flex"):
        assert reasons[name] is None, (name, reasons[name])


def test_on_a_gpu_node_with_the_libraries_every_row_runs(gpu_node, monkeypatch) -> None:
    from embodyhpc.models import attention

    monkeypatch.syspath_prepend(str(DOUBLES))
    drop_modules("flash_attn", "transformer_engine")
    attention._flash_attn_installed.cache_clear()
    try:
        rows, _ = plan_rows()
        assert all(reason is None for _, reason in rows), _reasons(rows)
        assert len(rows) == 4 + 1 + 3 + 1 + 3
    finally:
        drop_modules("flash_attn", "transformer_engine")
        attention._flash_attn_installed.cache_clear()


def test_a_node_with_one_gpu_skips_the_fsdp_row(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA L4")
    assert _reasons(plan_rows()[0])["fsdp2 x2 gpus"] == "needs 2 GPUs, this node has 1"


def test_a_row_whose_process_fails_is_a_failed_row_with_the_error() -> None:
    row = smoke._run_in_process(SmokePath("broken", device="cpu", precision="fp16"), steps=4, size="tiny")
    assert row.status == "failed" and "precision.mode" in row.reason


def test_the_recipe_row_is_marked() -> None:
    from embodyhpc.config.load import load_recipe

    config = load_recipe("smoke_cpu", []).config
    marked = [path.name for path in smoke.CPU_PATHS + tuple(smoke.gpu_paths(2)) if smoke.matches_recipe(path, config)]
    assert marked and all("fsdp" not in name for name in marked)


@pytest.mark.slow
def test_smoke_on_this_machine_runs_the_cpu_references_and_skips_every_gpu_row(cli) -> None:
    result = cli("smoke", "--steps", "6", "--json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    rows = {row["path"]["name"]: row for row in report["rows"]}
    ran = [row for row in report["rows"] if row["status"] != "skipped"]
    assert report["ok"] and report["device"] == "CPU only"
    assert {row["path"]["name"] for row in ran} == {path.name for path in smoke.CPU_PATHS}
    for row in ran:
        assert row["status"] == "passed" and row["last_loss"] < row["first_loss"], row
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0
    assert rows["cpu torchao fp8"]["fp8_gemms"] > 0 and rows["cpu bf16"]["fp8_gemms"] is None
    for row in report["rows"]:
        if row["path"]["device"] == "cuda":
            assert row["status"] == "skipped" and row["reason"].startswith("no CUDA device"), row


def test_smoke_refuses_bad_options(cli) -> None:
    for args, key in ((("--size", "full"), "--size"), (("--steps", "2"), "--steps"), (("--submit",), "--submit")):
        result = cli("smoke", *args)
        assert result.code == 2 and key in result.err, result.err


@pytest.mark.gpu
@pytest.mark.slow
def test_smoke_on_a_gpu_node_passes_every_row_that_runs(cli) -> None:
    result = cli("smoke", "--steps", "10", "--json")
    report = json.loads(result.out)
    assert result.code == 0 and report["ok"], [r for r in report["rows"] if r["status"] == "failed"]
    assert any(row["status"] == "passed" and row["path"]["device"] == "cuda" for row in report["rows"])
