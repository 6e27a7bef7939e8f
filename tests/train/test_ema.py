"""The moving average of the weights (train.ema_decay, train/ema.py) against one computed here, independently.

The reference: e_0 = the weights training starts from, e_t = d * e_(t-1) + (1 - d) * w_t with w_t the full weights
after optimizer step t, in float64 from the recorded trajectory. A decay of 0.75 keeps the average far from the raw
weights, from the average of the weights one step late, and from the one with d and 1 - d swapped.

- on one process: ParameterEMA alone (its formula, fp32, frozen parameters left out, state-dict names);
- on 2 gloo ranks: the training loop itself (tiny pi0.5, FSDP2, the LeRobot fixture), recording the full weights
  after each of its optimizer steps: the average equals the reference at every step, is held as DTensor shards of
  the parameters' local size (no full copy per rank), and the run's export holds the weights its recipe names.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from embodyhpc.checkpoint import load_exported
from embodyhpc.config.resolve import resolve
from embodyhpc.errors import ConfigError
from embodyhpc.train import loop
from embodyhpc.train.ema import ParameterEMA, build_ema, state_dict_name
from tests.parallel.harness import run_ranks
from tests.train import workers

DECAY = 0.75
STEPS, EVERY = 3, 2


def reference_average(trajectory: list[dict[str, torch.Tensor]], decay: float) -> list[dict[str, torch.Tensor]]:
    """[e_0, e_1, ...] in float64: e_0 = trajectory[0], e_t = decay * e_(t-1) + (1 - decay) * trajectory[t]."""
    averages = [{k: v.double() for k, v in trajectory[0].items()}]
    for weights in trajectory[1:]:
        averages.append({k: decay * averages[-1][k] + (1 - decay) * weights[k].double() for k in weights})
    return averages


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ---- one process ----
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3))
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) * self.frozen


def test_the_average_after_n_steps_equals_the_hand_computed_one_in_fp32():
    torch.manual_seed(0)
    model = Tiny()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ema = ParameterEMA(model, DECAY)
    trajectory = [{k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}]
    for _ in range(6):
        model(torch.randn(4, 6)).square().mean().backward()
        optimizer.step()
        ema.update()
        optimizer.zero_grad()
        trajectory.append({k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad})
    want = reference_average(trajectory, DECAY)[-1]
    got = ema.state_dict()
    assert "frozen" not in got and got.keys() == want.keys()  # a frozen parameter's average is itself
    assert all(t.dtype == torch.float32 for t in got.values())
    assert _max_diff(got, want) < 1e-6
    assert _max_diff(want, trajectory[-1]) > 1e-3, "the average must differ from the raw weights to show anything"


def test_names_are_the_state_dicts_and_a_decay_outside_0_1_is_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)))
    assert set(ParameterEMA(model, 0.9).state_dict()) == set(model.state_dict()) == {"0.weight", "0.bias"}
    assert state_dict_name("a._checkpoint_wrapped_module.b._orig_mod.w") == "a.b.w"
    for bad in (0.0, 1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            ParameterEMA(model, bad)
    with pytest.raises(ConfigError, match="eval.weights_kind.*train.ema_decay is null") as caught:
        build_ema(model, None, "ema")
    assert "\n" not in caught.value.one_line()
    assert build_ema(model, None, None) is None and build_ema(model, None, "raw") is None


def test_the_recipe_refuses_a_decay_outside_0_1_and_an_unknown_kind():
    from embodyhpc.config.schema import EvalConfig, TrainConfig

    assert TrainConfig().ema_decay is None and EvalConfig().weights_kind is None  # off unless asked
    for bad in (0.0, 1.0, 2.0, float("nan")):
        with pytest.raises(ConfigError, match="train.ema_decay.*strictly between 0 and 1"):
            TrainConfig(ema_decay=bad)
    with pytest.raises(ConfigError, match="eval.weights_kind.*'average' is not one of ema, raw"):
        EvalConfig(weights_kind="average")


# ---- the training loop on 2 gloo ranks ----
def _full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full copies (a collective for DTensors: every rank calls it)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in tensors.items()}


def _layout(run: loop.TrainRun) -> dict[str, tuple]:
    """{name: (is a DTensor with the parameter's mesh and placements, its local shape, the parameter's local shape,
    the global shape, the local dtype)} of this rank's average."""
    params = {state_dict_name(n): p for n, p in run.model.named_parameters()}
    out = {}
    for name, average in run.ema.state_dict().items():
        param = params[name]
        sharded_alike = isinstance(param, DTensor) and isinstance(average, DTensor) and (
            average.placements == param.placements and average.device_mesh == param.device_mesh)
        local = average.to_local() if sharded_alike else average
        out[name] = (sharded_alike, tuple(local.shape), tuple(param.to_local().shape), tuple(average.shape),
                     local.dtype)
    return out


def ema_train_job(rank: int, world_size: int, run_dir: str, steps: int, every: int,
                  weights_kind: str | None = None) -> dict:
    """The loop with train.ema_decay=DECAY; records the full weights and average after set-up and after every
    optimizer step (train_step: the step's update and its average), and rank 0's export path."""
    cfg = workers.recipe(world_size, steps=steps, every_steps=every)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, ema_decay=DECAY),
                              eval=dataclasses.replace(cfg.eval, weights_kind=weights_kind))
    weights: list[dict] = []
    averages: list[dict] = []
    shards: list[dict] = []
    restore, train_step = loop.TrainRun._restore, loop.TrainRun.train_step

    def record(run: loop.TrainRun) -> None:
        weights.append(_full({state_dict_name(n): p for n, p in run.model.named_parameters()}))
        averages.append(_full(run.ema.state_dict()))

    def recording_restore(self):
        start = restore(self)
        record(self)
        shards.append(_layout(self))
        return start

    def recording_step(self):
        stats = train_step(self)
        record(self)
        return stats

    loop.TrainRun._restore, loop.TrainRun.train_step = recording_restore, recording_step  # this rank's process only
    dist_env = SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank)
    result = loop.train(cfg, resolve(cfg), run_dir=run_dir, dist_env=dist_env, device="cpu",
                        config_yaml="model: {size: tiny}\n")
    return {"weights": weights if rank == 0 else None, "averages": averages if rank == 0 else None,
            "shards": shards[0], "start_step": result.start_step, "export": result.export_path}


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("ema_run")
    return run_dir, run_ranks(ema_train_job, 2, str(run_dir), STEPS, EVERY, "raw", timeout_s=240)


def test_two_ranks_the_loops_average_equals_the_hand_computed_one_at_every_step(ema_run):
    _, results = ema_run
    weights, averages = results[0]["weights"], results[0]["averages"]
    assert len(weights) == len(averages) == STEPS + 1  # after set-up, then after each step
    want = reference_average(weights, DECAY)
    for step, (got, expected) in enumerate(zip(averages, want, strict=True)):
        assert _max_diff(got, expected) < 1e-6, f"step {step}"
    # what the reference would be one step late (an update before the optimizer step) is far from it
    late = reference_average(weights[:1] + weights[:-1], DECAY)[-1]
    assert _max_diff(want[-1], late) > 1e-5 and _max_diff(want[-1], weights[-1]) > 1e-5


def test_two_ranks_the_average_is_held_as_shards_of_the_parameters_local_size(ema_run):
    _, results = ema_run
    for rank_result in results:
        shards = rank_result["shards"]
        assert shards, "no parameter averaged"
        for name, (sharded_alike, local, param_local, full, dtype) in shards.items():
            assert sharded_alike and local == param_local and dtype == torch.float32, name
            # FSDP2 splits dim 0 over the 2 ranks: each holds at most half of it, never the full tensor
            assert local[1:] == full[1:] and local[0] <= -(-full[0] // 2), name
        held = sum(torch.Size(local).numel() for _, local, *_ in shards.values())
        assert held < sum(torch.Size(full).numel() for *_, full, _ in shards.values())


def test_two_ranks_the_export_holds_the_weights_the_recipe_names(ema_run):
    """The run's recipe says eval.weights_kind=raw: its export/ holds the raw weights; the same final checkpoint
    exported as the recipe's default (unset) holds the average."""
    from embodyhpc.checkpoint import export_consolidated

    run_dir, results = ema_run
    final_average, final_raw = results[0]["averages"][-1], results[0]["weights"][-1]
    raw, raw_summary = load_exported(run_dir / "export")
    assert raw_summary["weights_kind"] == "raw"
    for name, tensor in final_raw.items():
        assert torch.equal(raw[name], tensor), name

    export_consolidated(run_dir / "checkpoints" / f"step-{STEPS}", run_dir / "export-auto", config_yaml="m: 1\n")
    weights, summary = load_exported(run_dir / "export-auto")
    assert summary["weights_kind"] == "ema" and summary["ema_decay"] == DECAY
    for name, average in final_average.items():
        assert torch.equal(weights[name], average.to(weights[name].dtype)), name
    assert _max_diff({k: weights[k] for k in final_raw}, final_raw) > 1e-5, "the average is not the raw weights"


@pytest.mark.slow  # a second training job, on 1 rank
def test_resume_on_one_rank_restores_the_two_rank_average_bit_exactly(ema_run, tmp_path):
    run_dir, results = ema_run
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / f"step-{EVERY}", resumed / "checkpoints" / f"step-{EVERY}")
    got = run_ranks(ema_train_job, 1, str(resumed), EVERY + 1, EVERY, "raw", timeout_s=240)[0]
    assert got["start_step"] == EVERY
    saved = results[0]["averages"][EVERY]
    restored = got["averages"][0]
    assert restored.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(restored[name], tensor), name
