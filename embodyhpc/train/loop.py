"""The FSDP2 training loop for any model plug-in (models/spec.py, models/protocol.py), run by every rank.

    result = train(cfg, resolve(cfg), run_dir=run_dir, dist_env=dist_env, device="cuda", config_yaml=text)

A TrainRun holds the run's state (set-up, the step, the hooks after it, the final save); `train` drives it.

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
6. clip (train.grad_clip; 0 only measures the norm), optimizer step, the weights' moving average (train.ema_decay,
   ema.py: after the step, saved and resumed with the checkpoints), scheduler step, sampler accounting, metrics,
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
import dataclasses
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from embodyhpc.checkpoint import Checkpointer
from embodyhpc.checkpoint.sliced_weights import load_init_weights
from embodyhpc.config.data_mixture import eval_index
from embodyhpc.config.resolve import Resolved
from embodyhpc.config.schema import Config, DataConfig, ModelConfig, PrecisionConfig, TrainConfig
from embodyhpc.data import open_dataset
from embodyhpc.data.loader import build_dataloader
from embodyhpc.data.mixture_open import entry_delta_timestamps, open_mixture, run_normalizer, save_dataset_stats
from embodyhpc.data.normalize import StateNormalizer
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_model, build_tokenizer, model_spec
from embodyhpc.models.fp8 import FP8GemmCounter, fp8_autocast
from embodyhpc.models.spec import ModelSpec
from embodyhpc.parallel import build_mesh, materialize, parallelize
from embodyhpc.parallel.device import rank_device
from embodyhpc.rundir import CHECKPOINTS_DIR, EXPORT_DIR, METRICS_FILE
from embodyhpc.train.ema import ParameterEMA, build_ema
from embodyhpc.train.log_step import fp8_metrics, over_ranks, reduced_metrics
from embodyhpc.train.metrics import ConsoleMetricsSink, JsonlMetricsSink, MetricsSink, logs_at
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


def train(config: Config, resolved: Resolved, *, run_dir: str | Path, dist_env: RankInfo, device: torch.device | str,
          config_yaml: str = "", sinks: Sequence[MetricsSink] | None = None, stop: StopSignal | None = None,
          extra_sinks: Sequence[MetricsSink] = (),
          on_checkpoint: Callable[[int, Path], None] | None = None) -> TrainResult:
    """Train to config.train.steps, resuming from the newest complete checkpoint under run_dir/checkpoints.

    `resolved`: resolve(config) as the launcher computed it (the loop does not resolve the recipe again).
    `sinks` receive rank 0's metrics (default: run_dir/logs/metrics.jsonl and the console); other ranks ignore it.
    `extra_sinks` are added to those on rank 0 (the launcher's MLflow sink).
    `config_yaml` is the resolved recipe written next to the exported weights.
    `stop`: the launcher's installed StopSignal; without one the loop installs its own for its duration.
    `on_checkpoint(step, folder)`: rank 0, after each checkpoint is complete (Checkpointer's on_complete).
    """
    run = TrainRun(config, resolved, run_dir, dist_env, device, sinks=sinks, extra_sinks=extra_sinks,
                   on_checkpoint=on_checkpoint)
    with contextlib.ExitStack() as cleanup:
        run.loop(run.close_on_exit(cleanup, stop))
        export_path = run.finish(config_yaml)
    dist.barrier()  # FACTS: gloo ranks may abort at teardown without one
    return TrainResult(run.start_step, run.step, run.last_metrics, export_path, run.stopped_by)


@dataclass
class StepStats:
    """What one optimizer step measured on this rank; its metrics reduce these over ranks at log steps."""

    lr: float  # the rate this step's update used
    loss_sum: torch.Tensor  # the micro-batches' losses, unscaled
    wait_s: float = 0.0  # waiting for micro-batches
    num_tokens: int = 0
    budget_tokens: int = 0  # the token budget of packed micro-batches (0 when the collate does not pack)
    grad_norm: float = 0.0
    step_time_s: float = 0.0


class TrainRun:
    """One rank's training run from set-up to teardown, as torchtitan's Trainer holds its state: what set-up builds
    once (the constructor, in the module docstring's order) and the progress the loop advances."""

    config: Config
    """The recipe; its model names the tokenizer file this run reads (_policy_inputs), so all built from it agree."""
    resolved: Resolved
    run_dir: Path
    dist_env: RankInfo
    device: torch.device
    is_rank0: bool
    spec: ModelSpec
    model: nn.Module
    fp8_gemms: FP8GemmCounter
    amax_group: dist.ProcessGroup | None
    optimizer: torch.optim.Optimizer
    ema: ParameterEMA | None  # train.ema_decay's moving average of the weights (None without one)
    scheduler: torch.optim.lr_scheduler.LambdaLR
    loader: Any
    sampler: Any
    stream: BatchStream
    count_tokens: Callable[[Any, ModelConfig], int]
    token_budget: Callable[[Any, ModelConfig], int]
    ckpt: Checkpointer
    policy_files: dict[str, Path | None] | None  # rank 0's, beside the checkpoints: for exports of any step
    sinks: list[MetricsSink]
    stop_group: dist.ProcessGroup
    start_step: int  # the step the run resumed from (0 on a fresh run)
    step: int  # the last step trained (start_step before the first)
    last_metrics: dict[str, float]
    steps_since_log: int
    stopped_by: str | None

    def __init__(self, config: Config, resolved: Resolved, run_dir: str | Path, dist_env: RankInfo,
                 device: torch.device | str, *, sinks: Sequence[MetricsSink] | None = None,
                 extra_sinks: Sequence[MetricsSink] = (),
                 on_checkpoint: Callable[[int, Path], None] | None = None) -> None:
        self.resolved, self.run_dir, self.dist_env = resolved, Path(run_dir), dist_env
        self.device = rank_device(device, dist_env.local_rank)  # current before anything below allocates on it
        _check_world(self.resolved, dist_env)
        self.is_rank0 = dist_env.rank == 0
        self.spec = model_spec(config.model.name)
        self._build_model(config)
        _seed_rank_streams(config.train.seed + dist_env.rank)
        # statistics and tokenizer: the run's own (resume), the recipe's, or what model.init_weights carries
        data_root = _eval_root(config.data)  # a mixture's (data.datasets): the evaluation entry's
        # a mixture normalises with each dataset's own statistics (below), never model.init_weights' set
        asked = dataclasses.replace(config.model, norm_stats="dataset") if config.data.datasets else config.model
        model_cfg, normalizer, tokenizer_source = _policy_inputs(asked, data_root, self.run_dir / CHECKPOINTS_DIR,
                                                                 self.is_rank0)
        model_cfg = dataclasses.replace(model_cfg, norm_stats=config.model.norm_stats)
        if config.data.datasets:  # each dataset's own statistics; the run's on resume (data/mixture_open.py)
            normalizer = run_normalizer(config.data, model_cfg, self.run_dir / CHECKPOINTS_DIR)
        self.config = dataclasses.replace(config, model=model_cfg)
        self._build_data(normalizer)
        self.ckpt = Checkpointer(self.run_dir / CHECKPOINTS_DIR, config.checkpoint, seed=config.train.seed,
                                 device=self.device, on_complete=on_checkpoint)
        self.policy_files = write_policy_io(self.run_dir / CHECKPOINTS_DIR, data_root, model_cfg,
                                            getattr(normalizer, "eval", normalizer),
                                            tokenizer_source) if self.is_rank0 else None
        if self.is_rank0 and config.data.datasets:  # every dataset's statistics, beside the checkpoints
            save_dataset_stats(self.run_dir / CHECKPOINTS_DIR, normalizer, [e.root for e in config.data.datasets])
        self.start_step = self._restore()
        self.scheduler = _scheduler(self.optimizer, config.train, self.start_step)
        self.sinks = self._rank0_sinks(sinks, extra_sinks)
        self.stop_group = cpu_group()
        self.stream.group = self.stop_group  # a failed micro-batch on any rank fails it on every rank (stream.py)
        self.step, self.last_metrics, self.steps_since_log, self.stopped_by = self.start_step, {}, 0, None

    # ---- set-up ----
    def _build_model(self, config: Config) -> None:
        """On meta, parallelized (AC, compile, FSDP2), materialized seeded with train.seed only (the same full initial
        weights on any world size); then AdamW."""
        resolved, device = self.resolved, self.device
        mesh = build_mesh(resolved.dp_replicate, resolved.dp_shard, device.type, procs_per_node=resolved.procs_per_node)
        with torch.device("meta"):
            self.model = build_model(config.model, config.precision)
        parallelize(self.model, config.parallelism, config.precision, mesh)
        materialize(self.model, device, seed=config.train.seed)
        self.model.train()
        self.fp8_gemms = FP8GemmCounter(self.model, device)  # no layers (and nothing logged) unless precision.mode=fp8
        self.amax_group = dist.group.WORLD if dist.get_world_size() > 1 else None
        self.optimizer = build_optimizer(self.model, lr=config.train.lr, weight_decay=config.train.weight_decay)
        self.ema = build_ema(self.model, config.train.ema_decay, config.eval.weights_kind)

    def _build_data(self, normalizer: StateNormalizer) -> None:
        """This rank's share of the dataset, batched by the model's collate, and what the metrics count of a batch."""
        config, spec = self.config, self.spec
        self.loader, self.sampler = build_dataloader(
            _open(config.data, config.model, config.train.seed), config.data,
            micro_batch_size=config.train.micro_batch_size,
            rank=self.dist_env.rank, world_size=self.dist_env.world_size, seed=config.train.seed,
            device_type=self.device.type,
            collate_fn=spec.load("collate")(config.model, build_tokenizer(config.model), normalizer))
        self.count_tokens = spec.load("token_count")
        self.token_budget = spec.load("token_budget") if spec.token_budget is not None else lambda batch, cfg: 0
        self.stream = BatchStream(self.loader, self.sampler)

    def _restore(self) -> int:
        """The step to go on from: the newest complete checkpoint's (model, optimizer, RNG streams, sampler), or 0; a
        fresh run fine-tunes from model.init_weights when set (each rank reads its shard's slices)."""
        loaded = self.ckpt.load_latest(self.model, self.optimizer, ema=self.ema)
        if loaded is not None:
            if loaded.trainer.sampler is not None:
                self.sampler.load_state_dict(loaded.trainer.sampler)
            if self.ema is not None and not loaded.ema_restored:  # train.ema_decay set on resume: start it here
                self.ema.reset(note=f"{loaded.folder.name} holds no moving average" if self.is_rank0 else None)
            return loaded.step
        if self.config.model.init_weights:
            report = load_init_weights(self.model, self.config.model.init_weights,
                                       self.spec.load("weights") if self.spec.weights is not None else None)
            if self.is_rank0:
                print(f"init weights: {report.summary()}", flush=True)
        if self.ema is not None:  # the average starts at the weights training starts from
            self.ema.reset()
        return 0

    def _rank0_sinks(self, sinks: Sequence[MetricsSink] | None,
                     extra_sinks: Sequence[MetricsSink]) -> list[MetricsSink]:
        """Rank 0's: `sinks` (default: logs/metrics.jsonl from the start step on, and the console) and `extra_sinks`;
        no other rank writes metrics."""
        if not self.is_rank0:
            return []
        if sinks is None:
            sinks = [JsonlMetricsSink(self.run_dir / METRICS_FILE, resume_step=self.start_step), ConsoleMetricsSink()]
        return [*sinks, *extra_sinks]

    def close_on_exit(self, cleanup: contextlib.ExitStack, stop: StopSignal | None) -> StopSignal:
        """Teardown, entered into `cleanup` (which runs it last to first): the data workers end first, however the loop
        ends (loader.py), then the sinks, then the checkpointer (a job must not exit under an async save in flight),
        then the loop's own StopSignal, installed here when the launcher gave none. Returns the StopSignal to ask."""
        if stop is None:
            stop = cleanup.enter_context(StopSignal())
        cleanup.callback(self.ckpt.close)
        for sink in self.sinks:
            cleanup.callback(sink.close)
        cleanup.callback(self.stream.close)
        return stop

    # ---- the loop ----
    def loop(self, stop: StopSignal) -> None:
        """Steps start_step + 1 .. train.steps, each followed by its hooks: metrics, the stop agreement, a periodic
        save. Leaves `step` at the last step trained and `stopped_by` set when a stop ended it early."""
        for step in range(self.start_step + 1, self.config.train.steps + 1):
            self.step = step
            stats = self.train_step()
            self.log_metrics(step, stats)
            if self.ends_at(step, stop):
                break
            self.save_if_due(step, stats.lr)

    def train_step(self) -> StepStats:
        """One optimizer step: resolved.grad_accum_steps micro-batches, clip, optimizer and scheduler step, sampler
        accounting."""
        started = time.perf_counter()
        accum = self.resolved.grad_accum_steps
        stats = StepStats(lr=float(self.optimizer.param_groups[0]["lr"]), loss_sum=torch.zeros((), device=self.device))
        for micro in range(accum):
            self._micro_batch(stats, last=micro == accum - 1, loss_scale=1.0 / accum)
        stats.grad_norm = _clip_grad_norm(self.model.parameters(), self.config.train.grad_clip)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.stream.commit()
        stats.step_time_s = time.perf_counter() - started
        return stats

    def _micro_batch(self, stats: StepStats, *, last: bool, loss_scale: float) -> None:
        """Fetch, forward and backward one micro-batch; FSDP2 reduce-scatters gradients only on the `last`."""
        _set_gradient_sync(self.model, last)
        waited = time.perf_counter()
        batch = self.stream.next_batch()
        stats.wait_s += time.perf_counter() - waited
        stats.loss_sum += micro_batch_step(self.model, batch.to(self.device), self.config.precision,
                                           amax_group=self.amax_group, loss_scale=loss_scale)
        stats.num_tokens += self.count_tokens(batch, self.config.model)
        stats.budget_tokens += self.token_budget(batch, self.config.model)

    # ---- hooks after a step ----
    def log_metrics(self, step: int, stats: StepStats) -> None:
        """At log steps (every train.log_every, and the last): the metrics reduced over ranks (every rank), written to
        the sinks (rank 0's)."""
        self.steps_since_log += 1
        train_cfg, accum = self.config.train, self.resolved.grad_accum_steps
        if not logs_at(step, train_cfg.log_every, train_cfg.steps):
            return
        skipped = self.loader.skipped_samples if self.config.data.on_bad_sample == "skip" else None
        self.last_metrics = reduced_metrics(stats.loss_sum / accum, stats.grad_norm, stats.lr, stats.step_time_s,
                                             stats.wait_s, stats.num_tokens, stats.budget_tokens,
                                             train_cfg.micro_batch_size * accum, self.dist_env.world_size,
                                             self.device, skipped_samples=skipped)
        self.last_metrics.update(fp8_metrics(self.fp8_gemms, self.steps_since_log))
        self.last_metrics.update(over_ranks(self.stream.loader_metrics(), self.device))  # decode, loader rate
        self.steps_since_log = 0
        for sink in self.sinks:
            sink.write(step, self.last_metrics)

    def ends_at(self, step: int, stop: StopSignal) -> bool:
        """Whether the loop ends after `step`: the last step (a signal now changes nothing, the final save follows
        anyway), or a stop all ranks agreed on (every rank asks, every step: preempt.py), then in `stopped_by`."""
        if step == self.config.train.steps:
            return True
        self.stopped_by = stop.agreed(self.stop_group)
        if self.stopped_by is not None and self.is_rank0:
            print(f"step {step}: {self.stopped_by} received, saving and stopping (preemption or time limit)",
                  flush=True)
        return self.stopped_by is not None

    def save_if_due(self, step: int, lr: float) -> None:
        """A periodic (async) checkpoint when checkpoint.every_steps says one is due."""
        if self.ckpt.due(step):
            self.ckpt.save(step, self.model, self.optimizer, sampler_state=self.sampler.state_dict(), extra={"lr": lr},
                           ema=self.ema)

    # ---- the end ----
    def finish(self, config_yaml: str) -> Path | None:
        """The last step's checkpoint, blocking (the job may be requeued or killed right after this returns, and the
        checkpoint must be complete); then, unless a stop ended the run early, the export (with what evaluation needs
        to feed the policy as in training, hashed into export.json)."""
        self.ckpt.save(self.step, self.model, self.optimizer, sampler_state=self.sampler.state_dict(), blocking=True,
                       ema=self.ema)
        if not self.config.checkpoint.export_final or self.stopped_by is not None:
            return None
        return self.ckpt.export(self.run_dir / EXPORT_DIR, config_yaml=config_yaml, step=self.step,
                                side_files=self.policy_files, weights_kind=self.config.eval.weights_kind)


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


def _eval_root(data: DataConfig) -> str | None:
    """data.root, or the root of the mixture entry evaluation and export read (eval: true, else the first)."""
    return data.datasets[eval_index(data.datasets)].root if data.datasets else data.root


def _open(data: DataConfig, model_cfg: ModelConfig, seed: int = 0):
    if data.datasets and data.format != "synthetic":
        for i in range(len(data.datasets)):
            if ACTION_KEY not in entry_delta_timestamps(data, i):
                raise ConfigError(f"no action chunk requested: the model predicts {model_cfg.action_horizon} steps",
                                  key=f"data.datasets[{i}].delta_timestamps", related=("data.delta_timestamps",),
                                  fix="set data.delta_timestamps.action (or the entry's) to [i / fps for i in "
                                      f"range({model_cfg.action_horizon})]")
        return open_mixture(data, seed=seed)
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


def write_policy_io(export_dir: Path, data_root: str, model_cfg: ModelConfig, normalizer: StateNormalizer,
                    tokenizer_file: str | None = None) -> dict[str, Path | None]:
    """Next to the weights (the run's checkpoints/): the state statistics (normalization.json), policy_io.json (the
    dataset's cameras, image size, state key and real action dims) and a copy of the tokenizer file training read, if
    any, so an evaluation (and a resumed run) feeds the policy as training did. Returns {file name: path, or None for
    a tokenizer name it has no file of}: the side files an export of these weights copies and hashes."""
    from embodyhpc.atomic import replace_atomically, write_json_atomic
    from embodyhpc.data.info import dataset_info
    from embodyhpc.data.normalize import NORM_FILE
    from embodyhpc.models.checkpoint_assets import TOKENIZER_FILES, tokenizer_copy_name
    from embodyhpc.rundir import POLICY_IO_FILE

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

