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
from embodyhpc.models.pi05 import Pi05Policy, Pi05Sample
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


TE_FP8 = PrecisionConfig(mode="fp8", fp8_backend="te", fp8_recipe="current")


def init_scenario(rank: int, world: int) -> dict:
    """materialize on 2 ranks of a model holding every layer type (te.Linear from the transformer-engine double,
    the expert-state projection, adaRMS norms), every allocated parameter poisoned with NaN first; rank 0 also
    initialises the same model unsharded with the same seed."""
    import dataclasses

    from tests.helpers import use_doubles

    use_doubles("transformer_engine", gpu_node=True)
    cfg = dataclasses.replace(MODEL, state_input="expert", state_dim=6)
    with torch.device("meta"):
        model = build_model(cfg, TE_FP8)
    parallelize(model, ParallelismConfig(), TE_FP8, build_mesh(1, world, "cpu"))
    to_empty = model.to_empty

    def poisoned(*, device, recurse=True):
        result = to_empty(device=device, recurse=recurse)
        with torch.no_grad():
            for param in model.parameters():
                _local(param).fill_(float("nan"))
        return result

    model.to_empty = poisoned
    materialize(model, "cpu", seed=5)
    results = {"params": local_params(model)}
    if rank == 0:
        reference = build_model(cfg, TE_FP8)
        reference.init_weights(seed=5)
        results["reference"] = local_params(reference)
    return results


def fsdp_inputs_scenario(rank: int, world: int) -> dict:
    """One bf16 FSDP2 training forward+backward, spying on what the model and its layers receive: the flow-matching
    target's dtype and values, the token plans and attention plans built, the LayerContext each layer gets."""
    from embodyhpc.models.attention import AttentionLayout
    from embodyhpc.models.pi05 import model as pi05_model

    seen: dict = {"plans": 0, "prepares": 0, "actions": [], "shared": [], "rope_dtypes": []}
    build_plan, prepare, predict = pi05_model.build_token_plan, AttentionLayout.prepare, Pi05Policy.predict_velocity

    def counting_plan(**kwargs):
        seen["plans"] += 1
        return build_plan(**kwargs)

    def counting_prepare(self, *args, **kwargs):
        seen["prepares"] += 1
        return prepare(self, *args, **kwargs)

    def spying_predict(self, batch, *args, **kwargs):
        seen["actions"].append(batch.actions.detach().clone())
        return predict(self, batch, *args, **kwargs)

    pi05_model.build_token_plan = counting_plan
    AttentionLayout.prepare = counting_prepare
    Pi05Policy.predict_velocity = spying_predict
    model, _ = build_sharded(build_mesh(1, world, "cpu"), ParallelismConfig(), BF16)

    def spy_layer(module, args, kwargs):
        ctx = kwargs["ctx"]  # FSDP2 rebuilds it around the grad-requiring time condition; what it holds is shared
        seen["shared"].append((id(ctx.plan), id(ctx.joint_attention), id(ctx.suffix_attention)))
        seen["rope_dtypes"].append(str(ctx.prefix_rope[0].dtype))

    for layer in model.layers:
        layer.register_forward_pre_hook(spy_layer, with_kwargs=True)
    samples, noise, flow_time = step_data(0, PER_RANK * world)
    mine = samples[rank * PER_RANK:(rank + 1) * PER_RANK]
    batch = make_batch(MODEL, mine)
    model(batch, noise=noise[:PER_RANK], time=flow_time[:PER_RANK]).loss.backward()
    seen["given_actions"] = batch.actions.clone()
    seen["num_layers"] = len(model.layers)
    return seen


def compile_counts_scenario(rank: int, world: int, ac: str, num_batches: int) -> dict:
    """Per-block torch.compile (aot_eager, counted per block by CompileStats) under FSDP2 with AC `ac`, over
    `num_batches` packed batches of different compositions (3-5 samples, 1-2 cameras, prompts of 1-30 words)."""
    import torch._dynamo

    from embodyhpc.data.packing import first_fit_decreasing
    from embodyhpc.parallel.compile_stats import CompileStats

    torch._dynamo.reset()
    stats = CompileStats("aot_eager")
    with torch.device("meta"):
        model = build_model(MODEL, FP32)
    parallelize(model, ParallelismConfig(activation_checkpointing=ac, compile=True), FP32, build_mesh(1, world, "cpu"),
                compile_backend=stats.backend_for)
    stats.attach(model)
    materialize(model, "cpu", seed=0)
    g = torch.Generator().manual_seed(rank)
    words = "pick up the red cup and place it on the shelf near the open door slowly".split()
    for _ in range(num_batches):
        count = int(torch.randint(3, 6, (), generator=g))
        samples = [Pi05Sample(images=torch.rand(2, 3, 32, 32, generator=g),
                              instruction=" ".join(words[:int(torch.randint(1, 16, (), generator=g))] * 2),
                              state=torch.rand(6, generator=g) * 2 - 1,
                              image_mask=torch.tensor([True, bool(torch.randint(0, 2, (), generator=g))]),
                              actions=torch.randn(HORIZON, ACTION_DIM, generator=g)) for _ in range(count)]
        batch = make_batch(MODEL, samples)
        batch = batch.with_rows(first_fit_decreasing(batch.token_counts(16, HORIZON), MODEL.max_token_len))
        model(batch).loss.backward()
    return {"report": stats.report(), "breaks_total": stats.graph_breaks_total}


# ---- GR00T with a frozen VLM: what FSDP2 all-gathers in backward (tests/parallel/test_frozen_prefetch.py) ----
GROOT_TUNE = {"frozen": {}, "tune_llm": {"tune_llm": True}, "tune_visual": {"tune_visual": True},
              "trainable": {"tune_llm": True, "tune_visual": True}}


def frozen_prefetch_scenario(rank: int, world: int) -> dict:
    """The tiny GR00T sharded on `world` ranks for each tune option of GROOT_TUNE, two training steps each: per step,
    the units whose parameters were all-gathered during forward and during backward (counted at FSDP2's
    foreach_all_gather, the collective every unshard of a sharded group issues; a private function, hence the
    controls the test asserts: every unit is gathered in forward, the trained ones in backward)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    from embodyhpc.models.groot.batch import GrootSample, collate

    g = torch.Generator().manual_seed(10 + rank)
    samples = [GrootSample(images=torch.rand(2, 3, 32, 32, generator=g), text_ids=list(range(3, 3 + n)),
                           state=torch.randn(39, generator=g), actions=torch.randn(16, 4, generator=g))
               for n in (3, 20)]
    batch = collate(samples, embodiment_id=31).with_rows([[0, 1]])
    noise, flow_time = torch.randn(2, 16, 4, generator=g), torch.rand(2, generator=g)
    phase, gathered = ["idle"], []
    real_all_gather = _fsdp_param_group.foreach_all_gather

    def counting_all_gather(fsdp_params, *args, **kwargs):
        gathered.append((phase[0], fsdp_params[0]._param_fqn))
        return real_all_gather(fsdp_params, *args, **kwargs)

    _fsdp_param_group.foreach_all_gather = counting_all_gather
    results: dict = {}
    try:
        mesh = build_mesh(1, world, "cpu")
        for name, options in GROOT_TUNE.items():
            model_cfg = ModelConfig(name="groot", size="tiny", action_horizon=16, action_dim=4, max_token_len=96,
                                    options=options)
            model, plan = build_sharded(mesh, ParallelismConfig(), FP32, model_cfg)

            def unit_of(fqn: str, units=plan.units) -> str:
                fqn = _key(fqn)
                return next((unit for unit in units if fqn.startswith(unit + ".")), "<root>")

            steps = []
            for _ in range(2):
                gathered.clear()
                phase[0] = "forward"
                loss = model(batch, noise=noise, time=flow_time).loss
                phase[0] = "backward"
                loss.backward()
                phase[0] = "idle"
                steps.append({when: sorted(unit_of(fqn) for w, fqn in gathered if w == when)
                              for when in ("forward", "backward")})
                model.zero_grad()
            results[name] = {"units": plan.units, "steps": steps,
                             "trained": sorted({unit_of(n) for n, p in model.named_parameters() if p.requires_grad})}
    finally:
        _fsdp_param_group.foreach_all_gather = real_all_gather
    return results
