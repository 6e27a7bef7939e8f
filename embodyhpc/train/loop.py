"""The FSDP2 training loop for any model plug-in (models/spec.py, models/protocol.py), run by every rank.

    result = train(data=cfg.data, model_cfg=cfg.model, precision=cfg.precision, parallelism=cfg.parallelism,
                   train_cfg=cfg.train, checkpoint=cfg.checkpoint, resolved=resolve(cfg), run_dir=run_dir,
                   dist_env=dist_env, device=torch.device("cuda", dist_env.local_rank), config_yaml=text)

The process group must exist (launch/distributed creates it); the loop only uses it.

Order, and why:
1. model on meta -> parallelize (AC, compile, FSDP2) -> materialize seeded with train.seed only: every rank
   initialises the same full weights, so the run does not depend on the world size;
2. AdamW (decay groups in optim.py); then every rank reseeds its RNG streams with seed + rank: flow-matching
   noise and times (and any augmentation) differ between ranks, as data-parallel training needs;
3. Checkpointer.load_latest restores model, optimizer, RNG streams and sampler state (it overrides step 2's
   seeding, which is what makes a resumed step draw the same noise as the uninterrupted run);
4. the LR schedule is rebuilt from the step (schedule.py: no scheduler state to save);
5. each optimizer step runs resolved.grad_accum_steps micro-batches; FSDP2 reduce-scatters gradients only on the
   last (set_requires_gradient_sync), the earlier ones accumulate locally; the loss is divided by the number of
   micro-batches so the accumulated gradient is the mean over the global batch;
6. clip (train.grad_clip; 0 only measures the norm), optimizer and scheduler step, sampler accounting, metrics,
   the stop agreement (preempt.py), periodic async save; at the end a blocking save, the export,
   Checkpointer.close and a barrier.
7. Preemption or time limit (SIGUSR2, or SIGTERM, on any rank): every rank learns of it at the next step boundary
   through StopSignal.agreed (one 1-element all_reduce every step), all ranks leave the loop at that same step, save
   it with a blocking save and return with `stopped_by` set (no export: the run is not finished). Requeueing is the
   launcher's business (launch/train.py); resuming from that checkpoint continues exactly at the next step.

Collectives: every rank runs the same ones in the same order. Metrics are reduced on all ranks at log steps (the
condition depends only on the step), and only the writing of the reduced values happens on rank 0. Every micro-batch
fetch ends with one all_reduce on the CPU group (stream.py): a rank whose data failed (a worker's error, a dead or
stuck worker) makes every rank raise its DataWorkerError there, before any rank enters the micro-batch's
collectives; the DataLoader workers end with the loop however it ends (data/loader.py).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from embodyhpc.checkpoint import Checkpointer
from embodyhpc.checkpoint.sliced_weights import load_init_weights
from embodyhpc.config.resolve import Resolved
from embodyhpc.config.schema import (
    CheckpointConfig,
    DataConfig,
    ModelConfig,
    ParallelismConfig,
    PrecisionConfig,
    TrainConfig,
)
from embodyhpc.data import open_dataset
from embodyhpc.data.loader import build_dataloader
from embodyhpc.data.normalize import StateNormalizer
from embodyhpc.errors import ConfigError
from embodyhpc.launch.distributed import rank_device
from embodyhpc.models import build_model, build_tokenizer, model_spec
from embodyhpc.models.fp8 import FP8GemmCounter, fp8_autocast
from embodyhpc.parallel import build_mesh, materialize, parallelize
from embodyhpc.rundir import CHECKPOINTS_DIR, EXPORT_DIR, METRICS_FILE
from embodyhpc.train.metrics import ConsoleMetricsSink, JsonlMetricsSink, MetricsSink
from embodyhpc.train.optim import build_optimizer
from embodyhpc.train.preempt import StopSignal, cpu_group
from embodyhpc.train.schedule import warmup_cosine
from embodyhpc.train.stream import BatchStream


class RankInfo(Protocol):
    """What the loop needs of launch/distributed's DistEnv (tests pass a plain object)."""

    rank: int
    world_size: int
    local_rank: int


@dataclass(frozen=True)
class TrainResult:
    start_step: int
    """The step the run resumed from (0 on a fresh run)."""
    final_step: int
    last_metrics: dict[str, float]
    """The metrics of the last logged step (identical on every rank: they are reduced)."""
    export_path: Path | None
    """The exported weights (rank 0 only; None elsewhere, with checkpoint.export_final off, or after a stop)."""
    stopped_by: str | None = None
    """"SIGUSR2" or "SIGTERM" when the run stopped early for preemption or a time limit (the same on every rank);
    `final_step` is then the step saved (blocking) before returning. None when it trained to train.steps."""


def train(*, data: DataConfig, model_cfg: ModelConfig, precision: PrecisionConfig, parallelism: ParallelismConfig,
          train_cfg: TrainConfig, checkpoint: CheckpointConfig, resolved: Resolved, run_dir: str | Path,
          dist_env: RankInfo, device: torch.device | str, config_yaml: str = "",
          sinks: Sequence[MetricsSink] | None = None, stop: StopSignal | None = None,
          extra_sinks: Sequence[MetricsSink] = (),
          on_checkpoint: Callable[[int, Path], None] | None = None) -> TrainResult:
    """Train to train_cfg.steps, resuming from the newest complete checkpoint under run_dir/checkpoints.

    `sinks` receive rank 0's metrics (default: run_dir/logs/metrics.jsonl and the console); other ranks ignore it.
    `extra_sinks` are added to those on rank 0 (the launcher's MLflow sink).
    `config_yaml` is the resolved recipe written next to the exported weights.
    `stop`: the launcher's installed StopSignal; without one the loop installs its own for its duration.
    `on_checkpoint(step, folder)`: rank 0, after each checkpoint is complete (Checkpointer's on_complete).
    """
    run_dir = Path(run_dir)
    device = rank_device(device, dist_env.local_rank)  # current before anything below allocates on it
    _check_world(resolved, dist_env)
    rank, is_rank0 = dist_env.rank, dist_env.rank == 0
    accum = resolved.grad_accum_steps

    spec = model_spec(model_cfg.name)
    mesh = build_mesh(resolved.dp_replicate, resolved.dp_shard, device.type, procs_per_node=resolved.procs_per_node)
    with torch.device("meta"):
        model = build_model(model_cfg, precision)
    parallelize(model, parallelism, precision, mesh)
    materialize(model, device, seed=train_cfg.seed)  # the same full initial weights on any world size
    model.train()
    fp8_gemms = FP8GemmCounter(model, device)  # no layers (and nothing logged) unless precision.mode=fp8
    amax_group = dist.group.WORLD if dist.get_world_size() > 1 else None
    optimizer = build_optimizer(model, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
    _seed_rank_streams(train_cfg.seed + rank)

    # statistics and tokenizer: the run's own (resume), the recipe's, or what model.init_weights carries
    model_cfg, normalizer, tokenizer_source = _policy_inputs(model_cfg, data.root, run_dir / CHECKPOINTS_DIR, is_rank0)
    loader, sampler = build_dataloader(
        _open(data, model_cfg), data, micro_batch_size=train_cfg.micro_batch_size, rank=rank,
        world_size=dist_env.world_size, seed=train_cfg.seed, device_type=device.type,
        collate_fn=spec.load("collate")(model_cfg, build_tokenizer(model_cfg), normalizer))
    count_tokens = spec.load("token_count")
    token_budget = spec.load("token_budget") if spec.token_budget is not None else lambda batch, cfg: 0
    stream = BatchStream(loader, sampler)

    ckpt = Checkpointer(run_dir / CHECKPOINTS_DIR, checkpoint, seed=train_cfg.seed, device=device,
                        on_complete=on_checkpoint)
    policy_files = None  # beside the checkpoints: how to feed the policy, for exports of any step (final or not)
    if is_rank0:
        policy_files = write_policy_io(run_dir / CHECKPOINTS_DIR, data.root, model_cfg, normalizer, tokenizer_source)
    loaded = ckpt.load_latest(model, optimizer)
    start_step = 0
    if loaded is not None:
        start_step = loaded.step
        if loaded.trainer.sampler is not None:
            sampler.load_state_dict(loaded.trainer.sampler)
    elif model_cfg.init_weights:  # a fresh run fine-tunes from these (each rank reads its shard's slices)
        report = load_init_weights(model, model_cfg.init_weights,
                                   spec.load("weights") if spec.weights is not None else None)
        if is_rank0:
            print(f"init weights: {report.summary()}", flush=True)
    scheduler = _scheduler(optimizer, train_cfg, start_step)

    if not is_rank0:
        sinks = []
    elif sinks is None:
        sinks = [JsonlMetricsSink(run_dir / METRICS_FILE, resume_step=start_step), ConsoleMetricsSink()]
    if is_rank0:
        sinks = [*sinks, *extra_sinks]
    last_metrics: dict[str, float] = {}
    step = start_step
    steps_since_log = 0
    stopped_by: str | None = None
    stop_group = cpu_group()
    stream.group = stop_group  # a failed micro-batch on any rank fails it on every rank (stream.py)
    with contextlib.ExitStack() as cleanup:
        if stop is None:
            stop = cleanup.enter_context(StopSignal())
        cleanup.callback(ckpt.close)  # a job must not exit under an async save in flight
        for sink in sinks:
            cleanup.callback(sink.close)
        cleanup.callback(stream.close)  # first: the data workers end with the loop, however it ends (loader.py)
        for step in range(start_step + 1, train_cfg.steps + 1):
            started = time.perf_counter()
            lr = float(optimizer.param_groups[0]["lr"])  # the rate this step's update uses
            loss_sum = torch.zeros((), device=device)
            num_tokens, budget_tokens, wait_s = 0, 0, 0.0
            for micro in range(accum):
                _set_gradient_sync(model, micro == accum - 1)
                waited = time.perf_counter()
                batch = stream.next_batch()
                wait_s += time.perf_counter() - waited
                loss_sum += micro_batch_step(model, batch.to(device), precision, amax_group=amax_group,
                                             loss_scale=1.0 / accum)
                num_tokens += count_tokens(batch, model_cfg)
                budget_tokens += token_budget(batch, model_cfg)
            grad_norm = _clip_grad_norm(model.parameters(), train_cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            stream.commit()
            step_time_s = time.perf_counter() - started

            steps_since_log += 1
            if step % train_cfg.log_every == 0 or step == train_cfg.steps:
                last_metrics = _reduced_metrics(loss_sum / accum, grad_norm, lr, step_time_s, wait_s, num_tokens,
                                                budget_tokens, train_cfg.micro_batch_size * accum,
                                                dist_env.world_size, device,
                                                skipped_samples=loader.skipped_samples
                                                if data.on_bad_sample == "skip" else None)
                last_metrics.update(_fp8_metrics(fp8_gemms, steps_since_log))
                steps_since_log = 0
                for sink in sinks:
                    sink.write(step, last_metrics)
            if step == train_cfg.steps:
                break  # done: a signal now changes nothing, the final save below follows anyway
            stopped_by = stop.agreed(stop_group)  # every rank, every step (see preempt.py)
            if stopped_by is not None:
                if is_rank0:
                    print(f"step {step}: {stopped_by} received, saving and stopping (preemption or time limit)",
                          flush=True)
                break
            if ckpt.due(step):
                ckpt.save(step, model, optimizer, sampler_state=sampler.state_dict(), extra={"lr": lr})
        final_step = max(step, start_step)
        # blocking: the job may be requeued or killed right after this returns, and the checkpoint must be complete
        ckpt.save(final_step, model, optimizer, sampler_state=sampler.state_dict(), blocking=True)
        export_path = None
        if checkpoint.export_final and stopped_by is None:
            # with what evaluation needs to feed the policy as in training, hashed into export.json
            export_path = ckpt.export(run_dir / EXPORT_DIR, config_yaml=config_yaml, step=final_step,
                                      side_files=policy_files)
    dist.barrier()  # FACTS: gloo ranks may abort at teardown without one
    return TrainResult(start_step, final_step, last_metrics, export_path, stopped_by)


# ---- set-up helpers ----
def _check_world(resolved: Resolved, dist_env: RankInfo) -> None:
    if not dist.is_initialized():
        raise RuntimeError("train() needs an initialised process group (launch/distributed creates it)")
    live = dist.get_world_size()
    if live != resolved.world_size or live != dist_env.world_size:
        raise ConfigError(f"the job runs {live} processes (dist env says {dist_env.world_size}), the recipe resolved "
                          f"world_size={resolved.world_size}", key="resources.nodes",
                          related=("resources.tasks_per_node", "resources.gpus_per_node"),
                          fix="launch as many processes as the recipe resolves to")


ACTION_KEY = "action"  # the dataset feature every policy learns to predict, as a chunk (data.delta_timestamps)


def _open(data: DataConfig, model_cfg: ModelConfig):
    if data.format == "synthetic" or not data.root:
        raise ConfigError("the policy trainer reads a dataset on disk", key="data.format",
                          fix="set data.format=lerobot (or hdf5) and data.root=/path/to/dataset")
    if ACTION_KEY not in data.delta_timestamps:
        raise ConfigError(f"no action chunk requested: the model predicts {model_cfg.action_horizon} steps",
                          key="data.delta_timestamps", related=("model.action_horizon",),
                          fix=f"set data.delta_timestamps.action to [i / fps for i in "
                              f"range({model_cfg.action_horizon})]")
    return open_dataset(data.root, {key: list(value) for key, value in data.delta_timestamps.items()})


def _policy_inputs(model_cfg: ModelConfig, data_root: str | None, run_checkpoints: Path,
                   is_rank0: bool) -> tuple[ModelConfig, StateNormalizer, str | None]:
    """The state normaliser and the tokenizer file this run feeds the policy with (models/checkpoint_assets.py:
    the run's own on resume, the recipe's override, what model.init_weights carries, the dataset's); model_cfg
    names the tokenizer file from then on, so everything built from it reads the same one."""
    import dataclasses

    from embodyhpc.models.checkpoint_assets import fit_warning, resolve_normalizer, resolve_tokenizer

    normalizer, stats_from = resolve_normalizer(model_cfg, data_root, run_checkpoints=run_checkpoints)
    tokenizer_path, tokenizer_from = resolve_tokenizer(model_cfg, run_checkpoints=run_checkpoints)
    if is_rank0:
        print(f"state statistics ({model_cfg.state_norm}): {stats_from}; tokenizer: {tokenizer_from}", flush=True)
        warning = fit_warning(normalizer, data_root, stats_from)
        if warning:
            print(f"warning: {warning}", flush=True)
    return dataclasses.replace(model_cfg, tokenizer_path=tokenizer_path), normalizer, tokenizer_path


def _seed_rank_streams(seed: int) -> None:
    """Every stream the loop draws from after initialisation (the ones checkpoint/rng.py saves and restores)."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _scheduler(optimizer: torch.optim.Optimizer, train_cfg: TrainConfig,
               start_step: int) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR positioned at `start_step` (see schedule.py: the schedule is a function of the step alone)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = train_cfg.lr
    fn = warmup_cosine(train_cfg.warmup_steps, train_cfg.steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [fn] * len(optimizer.param_groups),
                                             last_epoch=start_step - 1)


# ---- step helpers ----
def micro_batch_step(model: nn.Module, batch, precision: PrecisionConfig, *, amax_group=None,
                     loss_scale: float = 1.0, **model_kwargs) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns the detached loss (unscaled).

    The forward runs in the precision's FP8 context (te.autocast for transformer-engine, one region per micro-batch:
    delayed scaling must not see a module twice in one region); backward runs outside it, as TE requires. The
    gradient is the loss times `loss_scale` (1 / micro-batches per step). `embodyhpc smoke` trains through this too.
    """
    with fp8_autocast(precision, amax_reduction_group=amax_group):
        loss = model(batch, **model_kwargs).loss
    (loss * loss_scale).backward()
    return loss.detach()


def _set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """FSDP2: skip the reduce-scatter on all but the last micro-batch (gradients accumulate unsharded until then).
    The one place that looks at the wrapper type."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)


def _clip_grad_norm(parameters, max_norm: float) -> float:
    """The global gradient norm before clipping; clips to max_norm unless it is 0.

    With DTensor gradients clip_grad_norm_ computes the norm over all shards (a collective: every rank calls it)
    and returns a DTensor; full_tensor() makes it a plain number. max_norm=inf measures without scaling.
    """
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm if max_norm > 0 else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def _reduced_metrics(loss: torch.Tensor, grad_norm: float, lr: float, step_time_s: float, wait_s: float,
                     num_tokens: int, budget_tokens: int, samples_per_device: int, world_size: int,
                     device: torch.device, *, skipped_samples: int | None = None) -> dict[str, float]:
    """Mean loss, step time and data wait over ranks, total tokens (and packing budget): one all_reduce on every
    rank. `packing_efficiency` (useful tokens / the token budget of the packed micro-batches) is there only when
    the collate packs (the budget is 0 otherwise, and the same decision follows on every rank from the sums).
    `skipped_samples` (data.on_bad_sample=skip, the same choice on every rank): this rank's bad samples skipped so
    far, summed over ranks into `data_skipped_samples`."""
    skipped = [] if skipped_samples is None else [float(skipped_samples)]
    values = torch.tensor([float(loss), step_time_s, wait_s, float(num_tokens), float(budget_tokens), *skipped],
                          dtype=torch.float64)
    values = values.to(device)
    dist.all_reduce(values)
    loss_mean, step_time_mean, wait_mean, tokens_total, budget_total = (values[:5] / torch.tensor(
        [world_size, world_size, world_size, 1, 1], dtype=torch.float64, device=device)).tolist()
    metrics = {"loss": loss_mean, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time_mean,
               "samples_per_s_per_device": samples_per_device / step_time_mean,
               "tokens_per_s": tokens_total / step_time_mean,
               "data_wait_fraction": wait_mean / step_time_mean if step_time_mean > 0 else 0.0}
    if budget_total > 0:
        metrics["packing_efficiency"] = tokens_total / budget_total
    if skipped:
        metrics["data_skipped_samples"] = float(values[5])
    return metrics


def _fp8_metrics(counter: FP8GemmCounter, steps: int) -> dict[str, float]:
    """fp8_gemms: forward GEMMs that ran in float8 per step on this rank (models/fp8.py FP8GemmCounter), averaged over
    the steps since the last log; fp8_gemms_fell_back: GEMMs of fp8 layers that ran in high precision (te layers
    outside te.autocast: should be 0). Nothing for a model without fp8 layers."""
    if counter.num_layers == 0:
        return {}
    fp8, fell_back = counter.take()
    return {"fp8_gemms": fp8 / max(steps, 1), "fp8_gemms_fell_back": fell_back / max(steps, 1)}


def write_policy_io(export_dir: Path, data_root: str, model_cfg: ModelConfig, normalizer: StateNormalizer,
                    tokenizer_file: str | None = None) -> dict[str, Path | None]:
    """Next to the weights (the run's checkpoints/): the state statistics (normalization.json), policy_io.json (the
    dataset's cameras, image size, state key and real action dims) and a copy of the tokenizer file training read, if
    any, so an evaluation (and a resumed run) feeds the policy as training did. Returns {file name: path, or None for
    a tokenizer name it has no file of}: the side files an export of these weights copies and hashes."""
    from embodyhpc.data.info import dataset_info
    from embodyhpc.data.normalize import NORM_FILE
    from embodyhpc.models.checkpoint_assets import TOKENIZER_FILES, tokenizer_copy_name
    from embodyhpc.rundir import POLICY_IO_FILE, replace_atomically, write_json_atomic

    written: dict[str, Path | None] = dict.fromkeys(TOKENIZER_FILES)
    if tokenizer_file is not None:
        copy = Path(export_dir) / tokenizer_copy_name(tokenizer_file)
        if Path(tokenizer_file).resolve() != copy.resolve():
            data = Path(tokenizer_file).read_bytes()
            replace_atomically(copy, lambda tmp: Path(tmp).write_bytes(data))
        written[copy.name] = copy

    info = dataset_info(data_root)
    features = info.get("features", {})
    cameras = [key.removeprefix("observation.images.") for key in info.get("cameras", [])]
    sizes = {features[f"observation.images.{c}"]["shape"][0] for c in cameras if f"observation.images.{c}" in features}
    action = features.get("action", {}).get("shape") or [model_cfg.action_dim]
    normalizer.save(export_dir)
    write_json_atomic(export_dir / POLICY_IO_FILE, {
        "cameras": cameras, "image_size": max(sizes) if sizes else None, "state_key": model_cfg.state_key,
        "action_dim": min(int(action[-1]), model_cfg.action_dim), "fps": info.get("fps")})
    return {NORM_FILE: Path(export_dir) / NORM_FILE, POLICY_IO_FILE: Path(export_dir) / POLICY_IO_FILE, **written}

