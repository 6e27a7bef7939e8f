"""`embodyhpc smoke`: on this CPU-only machine the CPU references run and every GPU row is skipped with its reason;
on a GPU node (availability monkeypatched: that is the whole branch) the rows offered follow the install. The model
smoked is the recipe's (pi0.5 without one), through its spec's smoke entry: pi0.5 and GR00T both train here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from embodyhpc.errors import ConfigError
from embodyhpc.models import model_spec, spec
from embodyhpc.train import smoke
from embodyhpc.train.smoke import SmokePath, plan_rows
from tests.helpers import DOUBLES, drop_modules, one_line_error

GROOT = "recipes/demo_groot_metaworld_cpu.yaml"


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
    for name in ("te fp8 current", "te fp8 delayed", "te fp8 block", "te fp8 resume + eval"):
        assert "needs transformer-engine" in reasons[name]
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
        assert len(rows) == 4 + 1 + 3 + 1 + 1 + 3  # attention, bf16, te x3, te chain, torchao, compile x2, fsdp
    finally:
        drop_modules("flash_attn", "transformer_engine")
        attention._flash_attn_installed.cache_clear()


def test_a_node_with_one_gpu_skips_the_fsdp_row(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA L4")
    assert _reasons(plan_rows()[0])["fsdp2 x2 gpus"] == "needs 2 GPUs, this node has 1"


@pytest.mark.slow
def test_a_row_whose_process_fails_is_a_failed_row_with_the_error() -> None:
    row = smoke._run_in_process(SmokePath("broken", device="cpu", precision="fp16"), steps=4, size="tiny")
    assert row.status == "failed" and "precision.mode" in row.reason


def test_the_recipe_row_is_marked() -> None:
    from embodyhpc.validation import load_recipe

    config = load_recipe("smoke_cpu", []).config
    marked = [path.name for path in smoke.CPU_PATHS + tuple(smoke.gpu_paths(2)) if smoke.matches_recipe(path, config)]
    assert marked and all("fsdp" not in name for name in marked)


def check_cpu_report(report: dict, model: str, size: str, policy: str) -> None:
    """Every CPU reference ran `policy` (as its own process reports) and passed with a falling loss; every GPU row
    was skipped for the missing device."""
    rows = {row["path"]["name"]: row for row in report["rows"]}
    ran = [row for row in report["rows"] if row["status"] != "skipped"]
    assert report["ok"] and report["device"] == "CPU only" and (report["model"], report["size"]) == (model, size)
    assert {row["path"]["name"] for row in ran} == {path.name for path in smoke.CPU_PATHS}
    for row in ran:
        assert row["status"] == "passed" and row["last_loss"] < row["first_loss"], row
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 0 and row["model"] == policy, row
    assert rows["cpu torchao fp8"]["fp8_gemms"] > 0 and rows["cpu bf16"]["fp8_gemms"] is None
    for row in report["rows"]:
        if row["path"]["device"] == "cuda":
            assert row["status"] == "skipped" and row["reason"].startswith("no CUDA device"), row
            assert row["model"] is None


@pytest.mark.slow
def test_smoke_of_a_groot_recipe_trains_groot_on_every_cpu_row(cli) -> None:
    """On this machine every CPU reference runs and every GPU row is skipped with its reason. pi0.5's table (the
    model smoked without a recipe) is checked the same way on the real cluster (tests/slurm/test_smoke_job.py):
    one run of each model's five rows, the slowest part of which is the CPU's reference FP8 GEMM."""
    result = cli("smoke", GROOT, "--steps", "4", "--json")
    assert result.code == 0, result.err
    check_cpu_report(json.loads(result.out), "groot", "tiny", "GrootPolicy")


def test_the_table_says_which_model_and_size_ran() -> None:
    row = smoke.SmokeRow(smoke.CPU_PATHS[0], "passed", first_loss=2.0, last_loss=1.5, model="GrootPolicy")
    report = smoke.SmokeReport([row], device="CPU only", model="groot", size="tiny")
    assert smoke.format_report(report).startswith("embodyhpc smoke of groot tiny on CPU only\n")
    assert report.as_dict()["model"] == "groot" and report.as_dict()["rows"][0]["model"] == "GrootPolicy"


@pytest.mark.slow
def test_a_groot_row_trains_groot_on_its_packed_batch() -> None:
    row = smoke._run_in_process(smoke.CPU_PATHS[0], steps=4, size="tiny", model="groot")
    assert row.status == "passed" and row.model == "GrootPolicy", row
    assert row.last_loss < row.first_loss and row.tokens_per_s > 0


def test_each_models_fixed_batch_is_packed_and_the_same_every_call() -> None:
    for name in ("pi05", "groot"):
        entry = smoke.smoke_model(name, "tiny")
        model_cfg = entry.config("tiny", "sdpa_reference")
        assert model_cfg.name == name
        batch, noise, flow_time, tokens = entry.fixed_batch(model_cfg, rank=0)
        again = entry.fixed_batch(model_cfg, rank=0)
        other = entry.fixed_batch(model_cfg, rank=1)
        assert torch.equal(noise, again[1]) and torch.equal(flow_time, again[2]) and tokens == again[3]
        assert not torch.equal(noise, other[1])  # each rank its own samples
        assert noise.shape == batch.actions.shape == (4, model_cfg.action_horizon, model_cfg.action_dim)
        assert bool(((flow_time > 0) & (flow_time < 1)).all())
        rows = batch.rows
        assert sorted(i for row in rows for i in row) == [0, 1, 2, 3] and len(rows) < 4, (name, rows)  # packed


def test_smoke_refuses_bad_options(cli) -> None:
    for args, key in ((("--size", "full"), "--size"), (("--steps", "2"), "--steps"), (("--submit",), "--submit")):
        result = cli("smoke", *args)
        assert result.code == 2 and key in result.err, result.err


@pytest.mark.parametrize(("recipe", "size", "fix"), [
    (GROOT, "full", "use --size tiny"), (GROOT, "small", "use --size tiny"), (GROOT, "huge", "use --size tiny"),
    (GROOT, "", "use --size tiny"), (GROOT, "tiny; touch pwned", "use --size tiny"),
    (None, "full", "use --size tiny or --size small"), (None, "small\ntiny", "use --size tiny or --size small"),
    ("smoke_cpu", "Tiny", "use --size tiny or --size small")])
def test_a_size_the_model_does_not_smoke_is_refused_naming_the_model(cli, runs_root, recipe, size, fix) -> None:
    model = "groot" if recipe == GROOT else "pi05"
    args = [recipe, f"job.runs_root={runs_root}"] if recipe else []
    line = one_line_error(cli("smoke", *args, "--size", size), "--size", f"the {model} model smokes", fix)
    assert repr(size) in line
    if recipe:  # refused before anything is submitted
        one_line_error(cli("smoke", *args, "--size", size, "--site", "local", "--submit"), "--size", fix)
        assert list(runs_root.iterdir()) == []


@pytest.mark.parametrize(("recipe", "model"), [("recipes/pi05_fp8.yaml", "pi05"),
                                               ("recipes/groot_n15_bf16.yaml", "groot")])
def test_a_gpu_recipe_without_a_dataset_is_smoked_all_the_same(cli, recipe, model) -> None:
    """The GPU recipes leave data.root `???` (the user's dataset); smoke reads no data, so they load: the first
    refusal is the size check (a size neither model smokes), not the missing dataset. Other commands still refuse."""
    line = one_line_error(cli("smoke", recipe, "--size", "huge"), "--size", f"the {model} model smokes")
    assert "data.root" not in line
    one_line_error(cli("validate", recipe), "data.root", "missing value")


def test_unread_keys_get_a_placeholder_and_only_those(tmp_path) -> None:
    from embodyhpc.config.load import UNREAD
    from embodyhpc.validation import load_recipe

    loaded = load_recipe("recipes/groot_n15_bf16.yaml", unread=("data.root",))
    assert loaded.config.data.root == UNREAD
    assert load_recipe("recipes/groot_n15_bf16.yaml", ["data.root=/data/mine"],
                       unread=("data.root",)).config.data.root == "/data/mine"
    recipe = tmp_path / "two_missing.yaml"
    recipe.write_text(f"base: {Path('recipes/groot_n15_bf16.yaml').resolve()}\njob:\n  name: ???\n")
    with pytest.raises(ConfigError, match="job.name"):
        load_recipe(str(recipe), unread=("data.root",))


@pytest.mark.parametrize("steps", ["3", "0", "-5"])
def test_too_few_steps_are_refused_for_either_model(cli, steps) -> None:
    for recipe in (GROOT, "smoke_cpu"):
        one_line_error(cli("smoke", recipe, "--steps", steps), "--steps", "use --steps 4 or more")


# smoke_cpu.yaml is written for pi0.5: its pi0.5-only keys go back to their defaults for a family that reads none
MLP_RESETS = ("model.attention_backend=auto", "model.max_token_len=256")


def test_a_model_without_a_smoke_entry_is_refused_naming_it(cli, runs_root, monkeypatch) -> None:
    from tests.plugins.mlp_policy import SPEC as MLP

    monkeypatch.setattr(spec, "_REGISTRY", dict(spec._REGISTRY))
    spec.register_model(MLP)
    assert MLP.smoke is None
    for extra in ([], ["--site", "local", "--submit"]):
        line = one_line_error(cli("smoke", "smoke_cpu", "model.name=mlp", *MLP_RESETS, f"job.runs_root={runs_root}",
                                  *extra),
                              "model.name", "the mlp model has no smoke entry", "smoke entry")
        assert "smoke_cpu" in line  # the recipe that names the model
        assert list(runs_root.iterdir()) == []
    with pytest.raises(ConfigError, match="the mlp model has no smoke entry"):  # the job refuses it too
        smoke.run_smoke(None, model="mlp", steps=4)


@pytest.mark.parametrize(("entry", "says"), [
    ("tests.no_such_module:SMOKE", "cannot be imported"), ("embodyhpc.models.pi05.smoke:NO_SUCH", "cannot be imported"),
    (object(), "lacks sizes, other_sizes, config, fixed_batch")])
def test_a_broken_smoke_entry_is_refused_naming_the_plugin(cli, monkeypatch, entry, says) -> None:
    import dataclasses

    from tests.plugins.mlp_policy import SPEC as MLP

    monkeypatch.setattr(spec, "_REGISTRY", dict(spec._REGISTRY))
    spec.register_model(dataclasses.replace(MLP, smoke=entry))
    one_line_error(cli("smoke", "smoke_cpu", "model.name=mlp", *MLP_RESETS), "model.name",
                   "the mlp plug-in's smoke entry", says)


def test_the_size_help_names_each_shipped_models_smoke_sizes() -> None:
    from embodyhpc.cli.main import app
    from typer.testing import CliRunner

    text = " ".join(CliRunner().invoke(app, ["smoke", "-h"]).output.split())
    assert "--size" in text and "model (model.name; pi05 without a recipe)" in text
    for name in ("pi05", "groot"):
        assert f"{name} {' or '.join(model_spec(name).load('smoke').sizes)}" in text, text


@pytest.mark.gpu
@pytest.mark.slow
def test_smoke_on_a_gpu_node_passes_every_row_that_runs(cli) -> None:
    result = cli("smoke", "--steps", "10", "--json")
    report = json.loads(result.out)
    assert result.code == 0 and report["ok"], [r for r in report["rows"] if r["status"] == "failed"]
    assert any(row["status"] == "passed" and row["path"]["device"] == "cuda" for row in report["rows"])


def test_the_smoke_job_smokes_the_model_its_request_names_else_its_recipes(tmp_path, monkeypatch) -> None:
    """embodyhpc.launch.smoke (what `smoke --submit` runs): the model comes from smoke-request.json, the recipe's
    model.name when an older request lacks it; a model or size it cannot smoke fails the job before any row."""
    from embodyhpc.launch.smoke import smoke_task
    from embodyhpc.rundir import RESOLVED_YAML, SMOKE_FILE, SMOKE_REQUEST_FILE
    from embodyhpc.validation import load_recipe
    from tests.plugins.mlp_policy import SPEC as MLP

    monkeypatch.setattr(spec, "_REGISTRY", dict(spec._REGISTRY))
    spec.register_model(MLP)
    (tmp_path / RESOLVED_YAML).write_text(load_recipe(GROOT).to_yaml())
    request = tmp_path / SMOKE_REQUEST_FILE
    for body, says in (({"steps": 4, "size": "full"}, "the groot model smokes size tiny, not 'full'"),
                       ({"model": "pi05", "steps": 4, "size": "full"}, "the pi05 model smokes size tiny or small"),
                       ({"model": "mlp", "steps": 4, "size": "tiny"}, "the mlp model has no smoke entry")):
        request.write_text(json.dumps(body))
        with pytest.raises(ConfigError, match=says):
            smoke_task(str(tmp_path))
        assert not (tmp_path / SMOKE_FILE).exists()


@pytest.mark.slow  # importing torch._inductor's cudagraph trees takes ~4 s here
def test_cuda_graph_recordings_are_counted_from_torchs_recording_callback() -> None:
    """The count rests on two private pieces of torch, pinned here: cudagraph trees announce each recording through
    dynamo's callback handler with CallbackTrigger.CUDAGRAPH_RECORDING, and start callbacks see that trigger."""
    import inspect

    from torch._dynamo.callback import CallbackTrigger, callback_handler
    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

    assert "CallbackTrigger.CUDAGRAPH_RECORDING" in inspect.getsource(CUDAGraphTreeManager.record_function)
    with smoke.CudaGraphRecordings() as recordings:
        torch.compile(lambda x: x * 2, backend="eager")(torch.ones(3))  # a compilation is not a recording
        assert recordings.count == 0
        for _ in range(2):
            with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0/0"):
                pass
    with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0/0"):
        pass  # after the block: not counted
    assert recordings.count == 2 and recordings._started not in callback_handler.start_callbacks


def test_the_table_says_how_many_cuda_graphs_were_recorded_after_warm_up() -> None:
    path = SmokePath("compile + cuda graphs", compile=True, cuda_graphs=True)
    rows = [smoke.SmokeRow(path, "passed", first_loss=2.0, last_loss=1.5, cuda_graph_rerecords=n) for n in (12, 0)]
    rows.append(smoke.SmokeRow(SmokePath("bf16"), "passed", first_loss=2.0, last_loss=1.5))
    lines = smoke.format_report(smoke.SmokeReport(rows, device="NVIDIA H100 x1")).splitlines()
    assert lines[2].endswith("12 CUDA graphs recorded after warm-up (they re-record: no gain)")
    assert lines[3].endswith("0 CUDA graphs recorded after warm-up")
    assert "CUDA graphs" not in lines[4]


@pytest.mark.slow
def test_a_cuda_graphs_row_reports_its_recordings_after_warm_up() -> None:
    """The row's code path on the CPU (aot_eager has no CUDA graphs: 0 recorded); rows without graphs report none."""
    graphs = smoke._run_in_process(SmokePath("cpu compile + cuda graphs", device="cpu", precision="fp32",
                                             compile=True, cuda_graphs=True), steps=5, size="tiny")
    assert graphs.status == "passed" and graphs.cuda_graph_rerecords == 0, graphs
    plain = smoke._run_in_process(smoke.CPU_PATHS[0], steps=4, size="tiny")
    assert plain.status == "passed" and plain.cuda_graph_rerecords is None, plain


def test_a_gpu_node_reports_the_egl_device_of_its_cuda_device_0(gpu_node, monkeypatch) -> None:
    """EGL lists the node's GPUs in its own order: the smoke of a GPU node names the one whose EGL_CUDA_DEVICE_NV is
    the task's CUDA device 0 (embodyhpc/sim/egl.py; the device list is the hardware boundary, faked here)."""
    from embodyhpc.sim import egl
    from embodyhpc.train.smoke import egl_line

    devices = [egl.EglDevice(cuda_device=cuda, software=False, initialises=lambda: True) for cuda in (2, 0, 1)]
    monkeypatch.setattr(egl, "egl_devices", lambda: devices)
    for name in ("MUJOCO_EGL_DEVICE_ID", "MUJOCO_GL"):
        monkeypatch.delenv(name, raising=False)
    assert egl_line({}).startswith("EGL device 1 of 3")
    monkeypatch.setattr(egl, "egl_devices", lambda: [])
    assert egl_line({}).startswith("no EGL device: EGL lists no device")
    assert egl_line({"MUJOCO_EGL_DEVICE_ID": "0", "CUDA_VISIBLE_DEVICES": "0"}) == (
        "MUJOCO_EGL_DEVICE_ID or MUJOCO_GL set by the user")
