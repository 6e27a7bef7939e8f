"""`model.init_weights`: a published pi0.5 checkpoint (or an export) into the FSDP-sharded model, each rank reading
only the rows its shard holds (embodyhpc/checkpoint/sliced_weights.py, with models/pi05/weights.py's key rules)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from embodyhpc.models import build_model
from embodyhpc.models.pi05.weights import load_pi05_weights, save_pi05_weights
from tests.models.conftest import make_batch
from tests.parallel import init_weights_workers as workers
from tests.parallel.harness import run_ranks
from tests.parallel.workers import MODEL, PER_RANK, assemble, step_data


def published(tmp_path, dtype=None, prefix=""):
    """A checkpoint in the published layout at the tiny shapes: distinct random values in every tensor, small."""
    torch.manual_seed(5)
    source = build_model(MODEL)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in source.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    path = save_pi05_weights(source, tmp_path / "pi05_base.safetensors", dtype=dtype, key_prefix=prefix)
    return source, path


def reference_loss(path, world: int):
    model = build_model(MODEL)
    load_pi05_weights(model, path)
    samples, noise, flow_time = step_data(0, PER_RANK * world)
    with torch.no_grad():
        return model, model(make_batch(MODEL, samples), noise=noise, time=flow_time).loss.item()


def file_bytes(path) -> int:
    with safe_open(str(path), framework="pt") as f:
        return sum(f.get_slice(k)[...].nbytes for k in f.keys())


@pytest.mark.parametrize(("world", "dtype", "prefix"), [(2, None, ""), (3, torch.bfloat16, "model.")])
def test_fine_tuning_starts_from_the_checkpoint_and_no_rank_reads_all_of_it(tmp_path, world, dtype, prefix):
    """openpi layout in fp32 on 2 ranks; LeRobot's (model. prefix) in bf16 on 3 ranks (uneven shards)."""
    _, path = published(tmp_path, dtype, prefix)
    reference, loss = reference_loss(path, world)
    ranks = run_ranks(workers.load_and_loss, world, str(path), timeout_s=240)
    assert all(r["ok"] for r in ranks)
    assert all(r["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6) for r in ranks)  # step 0: the same function
    full = assemble([r["params"] for r in ranks])
    for name, value in reference.state_dict().items():
        assert torch.equal(full[name], value), name
    total = file_bytes(path)
    model_bytes = sum(t.numel() * (2 if dtype else 4) for t in reference.state_dict().values())
    for r in ranks:  # each rank reads about 1/world of the weights, and never one tensor whole that it does not own
        assert r["bytes_read"] < total / world * 1.25 and r["bytes_read"] < model_bytes
        assert r["largest_read"] < model_bytes / world
    assert sum(r["bytes_read"] for r in ranks) <= model_bytes * 1.01


@pytest.mark.slow  # 2-rank jobs: 2.6 s alone here, over the fast loop's budget
def test_refusals_reach_every_rank_in_one_line(tmp_path):
    source, path = published(tmp_path)
    tensors = load_file(path)
    cases = {}
    shrunk = dict(tensors)
    shrunk["action_out_proj.weight"] = shrunk["action_out_proj.weight"][:3]
    cases["shape"] = (shrunk, "action_out_proj.weight")
    ints = dict(tensors)
    ints["action_in_proj.weight"] = ints["action_in_proj.weight"].to(torch.int32)
    cases["dtype"] = (ints, "action_in_proj.weight holds I32")
    missing = dict(tensors)
    missing.pop("time_mlp_in.weight")
    cases["missing"] = (missing, "time_mlp_in.weight")
    for name, (content, _) in cases.items():
        save_file(content, str(tmp_path / f"{name}.safetensors"))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    cases["other"] = (None, "missing")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 64)
    cases["garbage"] = (None, "garbage.safetensors")
    for name, (_, expected) in cases.items():
        messages = run_ranks(workers.refused, 2, str(tmp_path / f"{name}.safetensors"),
                             timeout_s=180)
        assert all(expected in m and "\n" not in m for m in messages), (name, messages)
    # only one rank cannot read the file: both ranks raise (none waits in a collective)
    messages = run_ranks(workers.refused, 2, str(tmp_path / "nowhere.safetensors"),
                         timeout_s=180)
    assert all(m != "loaded" for m in messages)


def test_an_embodyhpc_export_loads_the_same_way(tmp_path):
    from safetensors.torch import save_file as save

    source, _ = published(tmp_path)
    export = tmp_path / "export"
    export.mkdir()
    save({k: v.contiguous() for k, v in source.state_dict().items()}, str(export / "model.safetensors"))
    (export / "export.json").write_text(json.dumps({"step": 1}))
    ranks = run_ranks(workers.load_and_loss, 2, str(export), timeout_s=240)
    full = assemble([r["params"] for r in ranks])
    for name, value in source.state_dict().items():
        assert torch.equal(full[name], value), name


@pytest.mark.slow
def test_a_fresh_run_fine_tunes_from_init_weights_and_a_resumed_one_ignores_them(tmp_path):
    from embodyhpc.checkpoint import load_exported
    from tests.train import workers as loop_workers

    cfg = loop_workers.recipe(2, steps=2, every_steps=2)
    torch.manual_seed(11)
    source = build_model(cfg.model)
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(0.5).add_(0.01)  # not what materialize gives
    path = save_pi05_weights(source, tmp_path / "base.safetensors")
    run = tmp_path / "run"
    run_ranks(loop_workers.train_job, 2, str(run), 2, 2, {"init_weights": str(path)}, timeout_s=240)
    weights, _ = load_exported(run / "export")
    lr = cfg.train.lr
    for name, value in source.state_dict().items():  # two AdamW steps of at most lr away from the checkpoint
        assert (weights[name] - value).abs().max() <= 2.5 * lr, name
    # the same run, more steps: it resumes from its own step-2 checkpoint, not from init_weights (gone by now)
    run_ranks(loop_workers.train_job, 2, str(run), 4, 2, {"init_weights": str(tmp_path / "gone.safetensors")},
              timeout_s=240)
    assert (run / "checkpoints" / "step-4").is_dir()


def test_an_unsharded_tensor_is_read_whole() -> None:
    """A single-process model (no DTensor) reads every row; a 0-d tensor has none to slice."""
    from embodyhpc.checkpoint.sliced_weights import local_rows

    assert local_rows(torch.zeros(5, 2)) == (0, 5)
    assert local_rows(torch.tensor(1.0)) == (0, 0)
