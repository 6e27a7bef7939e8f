"""Rank jobs for the GR00T loop test (imported by name by the forkserver ranks; not a test module): the tiny GR00T
on the LeRobot fixture (2 cameras of 48 px, state 6, action 4 padded to 8), packed VLM rows, AC on every block."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

from embodyhpc.config.resolve import resolve
from embodyhpc.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    ModelConfig,
    ParallelismConfig,
    PrecisionConfig,
    ResourcesConfig,
    TrainConfig,
)
from embodyhpc.train.loop import train
from tests.train.workers import FIXTURE

HORIZON = 4


def groot_recipe(world_size: int, steps: int, init_weights: str | None = None) -> Config:
    return Config(
        resources=ResourcesConfig(nodes=1, tasks_per_node=world_size),
        data=DataConfig(format="lerobot", root=str(FIXTURE), num_workers=0,
                        delta_timestamps={"action": [i / 10 for i in range(HORIZON)]}),
        model=ModelConfig(name="groot", size="tiny", action_horizon=HORIZON, action_dim=8, max_token_len=96,
                          packing=True, state_norm="mean_std", init_weights=init_weights),
        parallelism=ParallelismConfig(activation_checkpointing="full"),
        train=TrainConfig(steps=steps, global_batch_size=4 * world_size, micro_batch_size=2, lr=1e-3,
                          warmup_steps=1, grad_clip=1.0, seed=3, log_every=1),
        precision=PrecisionConfig(mode="fp32"),
        checkpoint=CheckpointConfig(every_steps=steps, keep_latest_k=2, async_save=False, export_final=True),
        eval=EvalConfig(execute_steps=HORIZON),  # resolve() refuses more actions per chunk than the horizon
    )


def groot_train_job(rank: int, world_size: int, run_dir: str, steps: int,
                    init_weights: str | None = None) -> dict[str, Any]:
    cfg = groot_recipe(world_size, steps, init_weights)
    dist_env = SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank)
    result = train(cfg, resolve(cfg), run_dir=run_dir, dist_env=dist_env, device="cpu",
                   config_yaml="model: {name: groot, size: tiny}\n")
    return asdict(result)
