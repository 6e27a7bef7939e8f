"""LoRA under FSDP2 and in checkpoints: the tiny pi0.5 with adapters (base frozen) sharded on 2 gloo ranks trains, its
checkpoint (adapters, their moving average and AdamW state) resumes bit-exactly on 1 rank, and its export is merged:
a plain model (no adapters, config without model.lora) that acts like the adapted one.

What is compared with what: the full weights, average and optimizer state gathered on the saving ranks before the
save, against what a fresh model of other initial values holds after loading on another world size; the exported
weights against W + (alpha / rank) B A computed here from those gathered tensors, and the exported model's actions
against the adapted model's (max abs difference).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from embodyhpc.checkpoint import Checkpointer, export_consolidated, load_exported
from embodyhpc.checkpoint.export import load_checked_export
from embodyhpc.config.lora_schema import LoraConfig
from embodyhpc.config.schema import CheckpointConfig
from embodyhpc.models import build_model
from embodyhpc.train.ema import ParameterEMA
from embodyhpc.train.optim import build_optimizer
from tests.checkpoint.distributed import MODEL_CFG, ToySampler, full_state, make_batch, run_ranks, seed_all, train_step

LORA = LoraConfig(rank=4, alpha=8.0, targets=["vlm", "expert"])
LORA_CFG = dataclasses.replace(MODEL_CFG, lora=LORA)
CONFIG_YAML = ("model:\n  name: pi05\n  size: tiny\n  action_horizon: 8\n  action_dim: 8\n  max_token_len: 160\n"
               "  lora:\n    rank: 4\n    alpha: 8.0\n    targets: [vlm, expert]\n")

# 2 then 1 gloo ranks: ~20 s on 2 cores (slow); the unit claims are also tests/models/test_lora.py's (fast)
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"), pytest.mark.slow]


def _adapted(init_seed: int):
    """The tiny pi0.5 with adapters, sharded as parallel/ shards it (each unit, then the root), AdamW over what
    trains, the moving average."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(init_seed)
    model = build_model(LORA_CFG)
    if dist.is_initialized():
        for unit in model.fsdp_units():
            fully_shard(unit)
        fully_shard(model)
    return model, build_optimizer(model, lr=1e-2, weight_decay=0.01), ParameterEMA(model, 0.5)


def _full(tensors):
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in tensors.items()}


def save_lora_job(rank: int, world_size: int, out: str) -> None:
    seed_all(100 + rank)
    model, optimizer, ema = _adapted(init_seed=0)
    sampler = ToySampler(rank, world_size)
    for _ in range(2):
        train_step(model, optimizer, None, sampler)
        ema.update()
    with Checkpointer(Path(out) / "checkpoints", CheckpointConfig(every_steps=1, keep_latest_k=2)) as ckpt:
        expected = {**full_state(model, optimizer), "ema": _full(ema.state_dict()),
                    "sharded": {n: type(p).__name__ for n, p in model.named_parameters() if p.requires_grad}}
        ckpt.save(2, model, optimizer, ema=ema)
        ckpt.wait()
    if rank == 0:
        torch.save(expected, Path(out) / "expected.pt")


def load_lora_job(rank: int, world_size: int, out: str) -> None:
    model, optimizer, ema = _adapted(init_seed=5)
    with Checkpointer(Path(out) / "checkpoints", CheckpointConfig(every_steps=1, keep_latest_k=2)) as ckpt:
        loaded = ckpt.load_latest(model, optimizer, ema=ema)
    found = {**full_state(model, optimizer), "ema": _full(ema.state_dict()), "ema_restored": loaded.ema_restored,
             "saved_world_size": loaded.saved_world_size}
    if rank == 0:
        torch.save(found, Path(out) / f"loaded_w{world_size}.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora_saved")
    run_ranks(save_lora_job, 2, str(out))
    return out


def _adapter_names(state: dict) -> set[str]:
    return {k for k in state if k.endswith((".lora_A", ".lora_B"))}


def test_adapters_shard_train_and_resume_bit_exactly_on_another_world_size(saved):
    want = torch.load(saved / "expected.pt", weights_only=True)
    adapters = _adapter_names(want["model"])
    assert adapters and set(want["sharded"]) == adapters and set(want["sharded"].values()) == {"DTensor"}
    assert set(want["ema"]) == adapters, "the average covers what trains, not the frozen base"
    # AdamW state for the adapters only (its state is keyed by parameter name in a full optimizer state dict)
    assert set(want["optim"]["state"]) == adapters
    assert any(want["model"][k].abs().sum() > 0 for k in adapters if k.endswith("lora_B")), "B never left zero"

    run_ranks(load_lora_job, 1, str(saved))
    got = torch.load(saved / "loaded_w1.pt", weights_only=True)
    assert got["saved_world_size"] == 2 and got["ema_restored"] is True
    for part in ("model", "ema"):
        assert got[part].keys() == want[part].keys()
        assert [k for k in want[part] if not torch.equal(got[part][k], want[part][k])] == [], part
    assert set(got["optim"]["state"]) == adapters
    assert all(torch.equal(got["optim"]["state"][k][m], want["optim"]["state"][k][m])
               for k in adapters for m in ("exp_avg", "exp_avg_sq"))


def test_the_export_is_merged_and_acts_like_the_adapted_model(saved, tmp_path, record_property):
    want = torch.load(saved / "expected.pt", weights_only=True)["model"]
    step = saved / "checkpoints" / "step-2"
    export_consolidated(step, tmp_path / "raw", config_yaml=CONFIG_YAML, weights_kind="raw")
    weights, summary, config, _ = load_checked_export(tmp_path / "raw")
    assert not config.model.lora.enabled and "lora" not in (tmp_path / "raw" / "config.yaml").read_text()
    assert _adapter_names(weights) == set() and weights.keys() == want.keys() - _adapter_names(want)
    layers = {k.removesuffix(".lora_A") for k in want if k.endswith(".lora_A")}
    assert summary["lora_merged"] == {"layers": len(layers), "scale": 2.0}
    for layer in layers:  # W + (alpha / rank) * B @ A, written out here
        expected = want[f"{layer}.weight"] + 2.0 * torch.einsum("or,ri->oi", want[f"{layer}.lora_B"],
                                                                  want[f"{layer}.lora_A"])
        torch.testing.assert_close(weights[f"{layer}.weight"], expected, rtol=1e-6, atol=1e-6)
    untouched = [k for k in weights if not any(k == f"{layer}.weight" for layer in layers)]
    assert all(torch.equal(weights[k], want[k]) for k in untouched)

    adapted = build_model(LORA_CFG)
    adapted.load_state_dict(want, strict=True)
    plain = build_model(MODEL_CFG)
    plain.load_state_dict(weights, strict=True)
    batch = make_batch(list(range(3)))
    noise = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((adapted.eval().sample_actions(batch, noise=noise)
                      - plain.eval().sample_actions(batch, noise=noise)).abs().max())
    record_property("max_abs_diff", diff)
    print(f"exported (merged) vs adapted pi0.5 actions: max abs difference {diff:.3g}")
    assert diff < 1e-5

    # the average's export merges the averaged adapters; a config without model.lora cannot say their scale
    export_consolidated(step, tmp_path / "ema", config_yaml=CONFIG_YAML, weights_kind="ema")
    assert load_exported(tmp_path / "ema")[1]["lora_merged"]["layers"] == len(layers)
    from embodyhpc.checkpoint import NotACheckpointError

    with pytest.raises(NotACheckpointError, match="holds LoRA adapters"):
        export_consolidated(step, tmp_path / "bare", config_yaml=CONFIG_YAML.split("  lora:")[0])


def loop_lora_job(rank: int, world_size: int, run_dir: str) -> dict:
    """The training loop (parallel/'s parallelize and materialize, FSDP2 on the gloo ranks) with model.lora."""
    from types import SimpleNamespace

    from embodyhpc.config.resolve import resolve
    from embodyhpc.train import loop
    from tests.train import workers

    cfg = workers.recipe(world_size, steps=2, every_steps=2, model_options={"lora": LORA})
    seen: dict = {}
    restore = loop.TrainRun._restore

    def recording_restore(self):
        seen["trainable"] = {n: type(p).__name__ for n, p in self.model.named_parameters() if p.requires_grad}
        seen["optimized"] = sum(len(group["params"]) for group in self.optimizer.param_groups)
        return restore(self)

    loop.TrainRun._restore = recording_restore  # this rank's process only
    config_yaml = CONFIG_YAML.replace("max_token_len: 160", "max_token_len: 128\n  packing: false").replace(
        "action_horizon: 8", f"action_horizon: {workers.HORIZON}")
    result = loop.train(cfg, resolve(cfg), run_dir=run_dir, device="cpu", config_yaml=config_yaml,
                        dist_env=SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank))
    return {**seen, "export": str(result.export_path) if result.export_path else None}


def test_the_training_loop_shards_the_adapters_and_exports_them_merged(tmp_path):
    from tests.parallel.harness import run_ranks as run_loop_ranks

    results = run_loop_ranks(loop_lora_job, 2, str(tmp_path), timeout_s=400)
    for result in results:
        assert result["trainable"] and set(result["trainable"]) == {
            n for n in result["trainable"] if n.endswith((".lora_A", ".lora_B"))}
        assert set(result["trainable"].values()) == {"DTensor"}, "the adapters are sharded like the rest"
        assert result["optimized"] == len(result["trainable"])
    weights, summary = load_exported(Path(results[0]["export"]).parent)
    assert summary["lora_merged"]["layers"] == len(results[0]["trainable"]) // 2
    assert not [k for k in weights if k.endswith((".lora_A", ".lora_B"))]
