"""What each spawned rank runs (module-level functions, so the spawn start method can import them).

Every scenario trains the tiny pi0.5 data-parallel: each step draws a global batch of PER_RANK x world samples
with fixed noise and flow times; rank r trains on its slice. The global loss of a step is the mean of the ranks'
losses (equal slice sizes), and FSDP averages gradients over ranks, so an unsharded model trained on the whole
batch must see the same losses and reach the same parameters.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from embodyhpc.config.resolve import resolve
from embodyhpc.config.schema import Config, ModelConfig, ParallelismConfig, PrecisionConfig, ResourcesConfig
from embodyhpc.models import build_model
from embodyhpc.models.pi05 import Pi05Sample
from embodyhpc.parallel import build_mesh, materialize, parallelize, precompute_fp8_scales
from embodyhpc.parallel.ac import WRAPPED_PREFIX
from embodyhpc.parallel.mesh import SHARD_DIM
from tests.models.conftest import ACTION_DIM, HORIZON, make_batch, make_samples

MODEL = ModelConfig(size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM, max_token_len=160)
FP32, BF16 = PrecisionConfig(mode="fp32"), PrecisionConfig(mode="bf16")
FP8 = PrecisionConfig(mode="fp8", fp8_backend="torchao", fp8_recipe="current")
PER_RANK, STEPS, LR = 2, 3, 1e-3


def step_data(step: int, num_samples: int):
    """The global batch of one step: samples, noise [N, H, A] and flow times [N], the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    noise, flow_time = torch.randn(num_samples, HORIZON, ACTION_DIM, generator=g), torch.rand(num_samples, generator=g)
    return make_samples(num_samples, seed=100 + step), noise, flow_time


def one_camera_step_data(step: int, num_samples: int):
    """Like step_data with the shortest samples pi0.5 takes (one camera, a two-letter prompt): for fp8 on CPU."""
    g = torch.Generator().manual_seed(2000 + step)
    samples = [Pi05Sample(images=torch.rand(1, 3, 32, 32, generator=g), instruction="go",
                          state=torch.rand(2, generator=g) * 2 - 1,
                          actions=torch.randn(HORIZON, ACTION_DIM, generator=g)) for _ in range(num_samples)]
    return samples, torch.randn(num_samples, HORIZON, ACTION_DIM, generator=g), torch.rand(num_samples, generator=g)


def build_sharded(mesh, parallel_cfg: ParallelismConfig, precision_cfg: PrecisionConfig = FP32,
                  model_cfg: ModelConfig = MODEL):
    """Meta build -> parallelize -> materialize, seeded like the unsharded reference."""
    with torch.device("meta"):
        model = build_model(model_cfg, precision_cfg)
    plan = parallelize(model, parallel_cfg, precision_cfg, mesh)
    torch.manual_seed(0)
    materialize(model, "cpu")
    return model, plan


def build_reference(model_cfg: ModelConfig = MODEL) -> nn.Module:
    model = build_model(model_cfg)
    torch.manual_seed(0)
    model.init_weights()
    return model


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's slice of every parameter by state-dict name; the test concatenates the ranks' slices
    (assemble()). No collectives: gathering each parameter here would cost one all-gather per tensor."""
    return {_key(name): _local(p).detach().clone() for name, p in model.named_parameters()}


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {_key(name): _local(p.grad).clone() for name, p in model.named_parameters() if p.grad is not None}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def assemble(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Full tensors from the dim-0 slices of one shard group's ranks, in rank order (FSDP2 shards like
    torch.chunk along dim 0)."""
    return {name: torch.cat([shards[name] for shards in per_rank]) for name in per_rank[0]}


def _key(name: str) -> str:
    # named_parameters() of the root shows the AC wrapper's submodule; state_dict() keys do not (wrapper hooks)
    return name.replace(WRAPPED_PREFIX, "")


def train(model: nn.Module, rank: int, world: int, *, steps: int = STEPS, precompute_scales: bool = False,
          sharded: bool = True, samples_per_rank: int = PER_RANK, data=step_data) -> dict:
    """Losses (global mean per step), this rank's gradient slices after the first backward and parameter slices
    at the end, seconds per step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses, first_grads, step_s = [], None, []
    for step in range(steps):
        started = time.perf_counter()
        samples, noise, flow_time = data(step, samples_per_rank * world)
        lo, hi = (rank * samples_per_rank, (rank + 1) * samples_per_rank) if sharded else (0, len(samples))
        loss = model(make_batch(MODEL, samples[lo:hi]), noise=noise[lo:hi], time=flow_time[lo:hi]).loss
        loss.backward()
        if step == 0:
            first_grads = local_grads(model)
        optimizer.step()
        optimizer.zero_grad()
        if precompute_scales:
            precompute_fp8_scales(model)
        global_loss = loss.detach().clone()
        if sharded:
            dist.all_reduce(global_loss)
            global_loss /= world
        losses.append(global_loss.item())
        step_s.append(time.perf_counter() - started)
    return {"losses": losses, "grads": first_grads, "params": local_params(model), "step_s": step_s}


def fsdp_scenarios(rank: int, world: int) -> dict:
    """2 ranks: fp32 (+ the three AC modes), bf16, inference through sample_actions, mesh refusals; rank 0 also
    trains the unsharded reference."""
    results: dict = {"errors": _mesh_refusals(world)}
    mesh = build_mesh(1, world, "cpu")
    scenarios = {
        "fp32": (ParallelismConfig(), FP32),
        "ac_full": (ParallelismConfig(activation_checkpointing="full"), FP32),
        "ac_every_k": (ParallelismConfig(activation_checkpointing="every_k", ac_every_k=2), FP32),
        "bf16": (ParallelismConfig(), BF16),
    }
    for name, (parallel_cfg, precision_cfg) in scenarios.items():
        model, plan = build_sharded(mesh, parallel_cfg, precision_cfg)
        results[name] = {"plan": plan, "init": local_params(model) if name == "fp32" else None,
                         **train(model, rank, world)}
        if name == "fp32":
            results["sample_actions"] = _sample_actions(model, rank)
    if rank == 0:
        reference = build_reference()
        results["reference_init"] = local_params(reference)
        results["reference"] = train(reference, rank, world, sharded=False)
        results["reference_sample_actions"] = _sample_actions(reference, None)
    return results


def _sample_actions(model: nn.Module, rank: int | None) -> torch.Tensor:
    """Actions for this rank's 2 inference samples (all 4 for the unsharded model, rank None)."""
    samples = make_samples(4, seed=7, with_actions=False)
    noise = torch.randn(4, HORIZON, ACTION_DIM, generator=torch.Generator().manual_seed(8))
    rows = slice(None) if rank is None else slice(2 * rank, 2 * rank + 2)
    return model.sample_actions(make_batch(MODEL, samples[rows]), num_steps=3, noise=noise[rows])


def _mesh_refusals(world: int) -> list[str]:
    """Error texts of meshes and plans that do not fit the running world (all raised before any collective)."""
    attempts = [
        lambda: build_mesh(1, 2 * world, "cpu"),
        lambda: build_mesh(world, 1, "cpu", procs_per_node=world),
        lambda: parallelize(build_reference(), ParallelismConfig(dp_replicate=2), FP32, build_mesh(1, world, "cpu")),
        lambda: parallelize(build_reference(), ParallelismConfig(), FP32,
                            init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
            messages.append("accepted")
        except Exception as exc:  # noqa: BLE001 - the test asserts on type and text
            messages.append(f"{type(exc).__name__}: {exc}")
    return messages


def hsdp_scenario(rank: int, world: int) -> dict:
    """4 ranks as 2 "nodes" of 2, degrees from resolve(): the mesh layout, placements and training equivalence;
    rank 0 also trains the unsharded reference."""
    config = Config(resources=ResourcesConfig(nodes=2, tasks_per_node=world // 2),
                    parallelism=ParallelismConfig(dp_replicate=2))
    resolved = resolve(config)
    mesh = build_mesh(resolved.dp_replicate, resolved.dp_shard, "cpu", procs_per_node=resolved.procs_per_node)
    model, plan = build_sharded(mesh, config.parallelism)
    weight = model.get_parameter("layers.0.vlm.q_proj.weight")
    results = {"plan": plan, "shard_group": dist.get_process_group_ranks(mesh.get_group(SHARD_DIM)),
               "placements": [str(p) for p in weight.placements], **train(model, rank, world)}
    if rank == 0:
        results["reference"] = train(build_reference(), rank, world, sharded=False)
    return results


def fp8_scenario(rank: int, world: int) -> dict:
    """torchao fp8 with float8 all-gather, 2 steps: the first gathers with per-weight scales, the second with the
    scales precompute_fp8_scales computed after step 1 in one all-reduce; and bf16 FSDP on the same data.

    CPU's e4m3 x e4m3 _scaled_mm runs a few million multiply-adds/s (tests/models/test_fp8.py): one short
    one-camera sample per rank keeps an fp8 step at a few seconds.
    """
    mesh = build_mesh(1, world, "cpu")
    model, plan = build_sharded(mesh, ParallelismConfig(), FP8)
    gathered = []
    layer = model.get_submodule("layers.0.vlm.q_proj")
    layer.register_forward_pre_hook(lambda module, args: gathered.append(type(module.weight).__name__))
    before = local_params(model)
    fp8 = train(model, rank, world, steps=2, precompute_scales=True, samples_per_rank=1, data=one_camera_step_data)
    bf16_model, _ = build_sharded(mesh, ParallelismConfig(), BF16)
    bf16 = train(bf16_model, rank, world, steps=2, samples_per_rank=1, data=one_camera_step_data)
    return {"plan": plan, "losses": fp8["losses"], "bf16_losses": bf16["losses"], "step_s": fp8["step_s"],
            "gathered_weight_types": gathered,
            "changed": [name for name in before if not torch.equal(before[name], fp8["params"][name])]}


def compile_scenario(rank: int, world: int) -> dict:
    """Per-block torch.compile with full AC under FSDP: trains like eager."""
    mesh = build_mesh(1, world, "cpu")
    results = {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        model, plan = build_sharded(mesh, ParallelismConfig(activation_checkpointing="full", compile=compile_))
        run = train(model, rank, world, steps=2)
        results[name] = {"plan": plan, "losses": run["losses"], "step_s": run["step_s"]}
    return results
