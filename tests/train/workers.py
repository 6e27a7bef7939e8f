"""Rank jobs for the training-loop tests: top-level functions the forkserver ranks import by name.

Not a test module (no test_ prefix). The recipe: the tiny pi0.5 on the LeRobot fixture (2 cameras of 48 px,
state 6, action 4 padded to 8, 10 fps), 2 ranks, micro-batch 2, global batch 8 -> 2 micro-batches per step.
"""

from __future__ import annotations

import itertools
import os
import signal
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from embodyhpc.config.resolve import resolve
from embodyhpc.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    ModelConfig,
    PrecisionConfig,
    ResourcesConfig,
    TrainConfig,
)
from embodyhpc.train import log_step, loop
from embodyhpc.train.loop import train
from embodyhpc.train.stream import BatchStream

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "lerobot_v30_sample"
HORIZON = 4


def recipe(world_size: int, *, steps: int, every_steps: int, export_final: bool = True, precision: str = "fp32",
           num_workers: int = 0, init_weights: str | None = None,
           model_options: dict[str, Any] | None = None) -> Config:
    return Config(
        resources=ResourcesConfig(nodes=1, tasks_per_node=world_size),
        data=DataConfig(format="lerobot", root=str(FIXTURE), num_workers=num_workers,
                        delta_timestamps={"action": [i / 10 for i in range(HORIZON)]}),
        model=ModelConfig(size="tiny", action_horizon=HORIZON, action_dim=8, max_token_len=128, packing=False,
                          init_weights=init_weights, **(model_options or {})),
        train=TrainConfig(steps=steps, global_batch_size=4 * world_size, micro_batch_size=2, lr=1e-3,
                          warmup_steps=1, grad_clip=1.0, seed=3, log_every=1),
        precision=PrecisionConfig(mode=precision),
        checkpoint=CheckpointConfig(every_steps=every_steps, keep_latest_k=3, async_save=True,
                                    export_final=export_final),
        eval=EvalConfig(execute_steps=HORIZON),  # resolve() refuses more actions per chunk than the horizon
    )


class RecordingDataset:
    """The dataset the loop opens, noting every index it reads (with num_workers=0 the DataLoader reads exactly
    the micro-batches the loop asks for, in order, so `drawn` is what this rank trained on)."""

    def __init__(self, inner: Any, drawn: list[int]) -> None:
        self.inner, self.drawn = inner, drawn

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        self.drawn.append(int(index))
        return self.inner[index]


class RecordingSink:
    """An extra metrics sink, as the launcher's MLflow one: what it was handed, in order ("close" when closed)."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def write(self, step: int, metrics: Any) -> None:
        self.events.append([step, dict(metrics)])

    def close(self) -> None:
        self.events.append("close")


def train_job(rank: int, world_size: int, run_dir: str, steps: int, every_steps: int,
              options: dict[str, Any] | None = None) -> dict[str, Any]:
    """`options`: further keyword arguments of recipe() (precision, num_workers). The result has the dataset
    indices this rank read under "drawn", and what an extra metrics sink given to every rank received under
    "extra_sink"."""
    cfg = recipe(world_size, steps=steps, every_steps=every_steps, **(options or {}))
    dist_env = SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank)
    drawn: list[int] = []
    open_dataset = loop._open
    loop._open = lambda data, model_cfg, *seed: RecordingDataset(open_dataset(data, model_cfg, *seed), drawn)
    sink = RecordingSink()
    result = train(cfg, resolve(cfg), run_dir=run_dir, dist_env=dist_env, device="cpu",
                   config_yaml="model: {size: tiny}\n", extra_sinks=[sink])
    return {**asdict(result), "drawn": drawn, "extra_sink": sink.events}


def signalled_job(rank: int, world_size: int, run_dir: str, steps: int, every_steps: int, signal_rank: int,
                  at_batch: int) -> dict[str, Any]:
    """train_job where rank `signal_rank` alone sends itself SIGUSR2 just before it fetches micro-batch number
    `at_batch` (1-based): a time-limit signal that reached one rank, in the middle of an optimizer step."""
    if rank == signal_rank:
        fetches = itertools.count(1)
        next_batch = BatchStream.next_batch

        def signalling_next_batch(self: BatchStream) -> Any:
            if next(fetches) == at_batch:
                os.kill(os.getpid(), signal.SIGUSR2)
            return next_batch(self)

        BatchStream.next_batch = signalling_next_batch  # this rank's process only
    return train_job(rank, world_size, run_dir, steps, every_steps)


def reduced_metrics_job(rank: int, world_size: int, tokens: list[int], budgets: list[int]) -> dict[str, float]:
    """The loop's metric reduction with this rank's token count and packing budget."""
    import torch

    return log_step.reduced_metrics(torch.tensor(1.0 + rank), 0.5, 1e-3, 2.0, 0.5, tokens[rank], budgets[rank], 4,
                                 world_size, torch.device("cpu"))


def te_train_job(rank: int, world_size: int, run_dir: str, steps: int, ac: str, recipe_name: str) -> dict[str, Any]:
    """train_job with precision fp8 on the transformer-engine double (tests/doubles), activation checkpointing
    `ac`: how many te.Linear forwards ran inside and outside te.autocast on this rank, and the last metrics.
    The recipe is resolved without te (resolve refuses te without GPUs); the loop gets the te precision section."""
    import dataclasses

    from embodyhpc.config.schema import ParallelismConfig
    from tests.helpers import use_doubles

    use_doubles("transformer_engine", gpu_node=True)
    from transformer_engine.pytorch.module import linear as te_linear

    forwards = {"fp8": 0, "high_precision": 0}
    forward = te_linear.Linear.forward

    def counting_forward(self, inp, *args, **kwargs):
        out = forward(self, inp, *args, **kwargs)
        forwards["fp8" if self.fp8 else "high_precision"] += 1
        return out

    te_linear.Linear.forward = counting_forward
    cfg = dataclasses.replace(recipe(world_size, steps=steps, every_steps=steps, export_final=False),
                              parallelism=ParallelismConfig(activation_checkpointing=ac))
    precision = PrecisionConfig(mode="fp8", fp8_backend="te", fp8_recipe=recipe_name)
    dist_env = SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank)
    result = train(dataclasses.replace(cfg, precision=precision), resolve(cfg), run_dir=run_dir, dist_env=dist_env,
                   device="cpu")
    return {"forwards": forwards, "last_metrics": result.last_metrics,
            "num_layers": sum(1 for _ in _te_layer_names(cfg.model))}


def _te_layer_names(model_cfg: ModelConfig):
    import torch

    from embodyhpc.models import build_model
    from embodyhpc.models.fp8 import fp8_linear_filter

    with torch.device("meta"):
        model = build_model(model_cfg)
    return [name for name, module in model.named_modules() if fp8_linear_filter(module, name)]


def cpu_group_under_nccl_job(rank: int, world_size: int) -> dict[str, Any]:
    """On a gloo group made to look like NCCL (get_backend answers "nccl", as in a GPU job): the side group
    cpu_group() creates, and which group the stop agreement and the launcher's hostname gather run on."""
    import torch.distributed as dist

    from embodyhpc.launch import train as launch_train
    from embodyhpc.train.preempt import StopSignal, cpu_group

    real_get_backend, real_new_group = dist.get_backend, dist.new_group
    real_all_reduce, real_all_gather = dist.all_reduce, dist.all_gather
    new_groups: list[dict[str, Any]] = []
    used: list[tuple[str, Any]] = []

    def new_group(*args, **kwargs):
        new_groups.append({"args": args, **kwargs})
        return real_new_group(*args, **kwargs)

    def all_reduce(tensor, *args, group=None, **kwargs):
        used.append(("all_reduce", group))
        return real_all_reduce(tensor, *args, group=group, **kwargs)

    def all_gather(tensors, tensor, *args, group=None, **kwargs):
        used.append(("all_gather", group))
        return real_all_gather(tensors, tensor, *args, group=group, **kwargs)

    dist.get_backend = lambda group=None: "nccl" if group in (None, dist.group.WORLD) else real_get_backend(group)
    dist.new_group, dist.all_reduce, dist.all_gather = new_group, all_reduce, all_gather
    try:
        side = cpu_group()
        stop = StopSignal()
        if rank == world_size - 1:
            stop.request(signal.SIGUSR2)  # only the last rank received it
        agreed = stop.agreed(side)
        hostnames = launch_train._gather_hostnames(world_size)
    finally:
        dist.get_backend, dist.new_group = real_get_backend, real_new_group
        dist.all_reduce, dist.all_gather = real_all_reduce, real_all_gather
    return {"new_groups": [{k: v for k, v in call.items() if k != "timeout"} for call in new_groups],
            "side_backend": real_get_backend(side), "side_ranks": dist.get_process_group_ranks(side),
            "agreed": agreed,
            "collectives": [(name, "side" if group is side else "gloo" if group is not None else "default")
                            for name, group in used], "num_hostnames": len(hostnames)}


def te_layers_extra_state(model) -> dict[str, bytes]:
    """{fqn: the te.Linear's get_extra_state() bytes} of a model (FSDP2-wrapped or not)."""
    return {name: bytes(module.get_extra_state().numpy().tobytes()) for name, module in model.named_modules()
            if type(module).__module__.startswith("transformer_engine")}


def te_chain_job(rank: int, world_size: int, run_dir: str, steps: int) -> dict[str, Any]:
    """Training with precision fp8 on transformer-engine (the double, standing for a GPU node), delayed scaling,
    async checkpoints every 2 steps, a global batch of 8 whatever the world size. A job that finds a checkpoint in
    run_dir resumes from it: what each te.Linear's extra state holds right after the checkpoint was loaded is
    returned under "loaded_extra_state" (rank 0's), as are the logged fp8 GEMM counts."""
    import dataclasses

    from embodyhpc.checkpoint import checkpointer
    from tests.helpers import use_doubles

    use_doubles("transformer_engine", gpu_node=True)
    loaded: dict[str, bytes] = {}
    load = checkpointer.Checkpointer.load

    def recording_load(self, step, model, optimizer, **options):  # options: the loop's (ema=...)
        result = load(self, step, model, optimizer, **options)
        loaded.update(te_layers_extra_state(model))
        return result

    checkpointer.Checkpointer.load = recording_load
    base = recipe(world_size, steps=steps, every_steps=2, export_final=False)
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch_size=8))
    precision = PrecisionConfig(mode="fp8", fp8_backend="te", fp8_recipe="delayed")
    dist_env = SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank)
    result = train(dataclasses.replace(cfg, precision=precision), resolve(cfg), run_dir=run_dir, dist_env=dist_env,
                   device="cpu")
    return {"loaded_extra_state": loaded, "last_metrics": result.last_metrics, "start_step": result.start_step,
            "final_step": result.final_step}


def te_recipe_yaml() -> str:
    """The resolved recipe of te_chain_job's training (precision fp8 on transformer-engine), as an export holds it."""
    import dataclasses

    from embodyhpc.config.load import dump_yaml

    cfg = recipe(2, steps=3, every_steps=2, export_final=False)
    return dump_yaml(dataclasses.replace(cfg, precision=PrecisionConfig(mode="fp8", fp8_backend="te",
                                                                        fp8_recipe="delayed")))
