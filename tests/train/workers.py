"""Rank jobs for the training-loop tests: top-level functions the forkserver ranks import by name.

Not a test module (no test_ prefix). The recipe: the tiny pi0.5 on the LeRobot fixture (2 cameras of 48 px,
state 6, action 4 padded to 8, 10 fps), 2 ranks, micro-batch 2, global batch 8 -> 2 micro-batches per step.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from embodyhpc.config.resolve import resolve
from embodyhpc.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    ModelConfig,
    PrecisionConfig,
    ResourcesConfig,
    TrainConfig,
)
from embodyhpc.train.loop import train

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "lerobot_v30_sample"
HORIZON = 4


def recipe(world_size: int, *, steps: int, every_steps: int, export_final: bool = True, precision: str = "fp32",
           num_workers: int = 0) -> Config:
    return Config(
        resources=ResourcesConfig(nodes=1, tasks_per_node=world_size),
        data=DataConfig(format="lerobot", root=str(FIXTURE), num_workers=num_workers,
                        delta_timestamps={"action": [i / 10 for i in range(HORIZON)]}),
        model=ModelConfig(size="tiny", action_horizon=HORIZON, action_dim=8, max_token_len=128, packing=False),
        train=TrainConfig(steps=steps, global_batch_size=4 * world_size, micro_batch_size=2, lr=1e-3,
                          warmup_steps=1, grad_clip=1.0, seed=3, log_every=1),
        precision=PrecisionConfig(mode=precision),
        checkpoint=CheckpointConfig(every_steps=every_steps, keep_latest_k=3, async_save=True,
                                    export_final=export_final),
    )


def train_job(rank: int, world_size: int, run_dir: str, steps: int, every_steps: int,
              options: dict[str, Any] | None = None) -> dict[str, Any]:
    """`options`: further keyword arguments of recipe() (precision, num_workers)."""
    cfg = recipe(world_size, steps=steps, every_steps=every_steps, **(options or {}))
    dist_env = SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank)
    result = train(data=cfg.data, model_cfg=cfg.model, precision=cfg.precision, parallelism=cfg.parallelism,
                   train_cfg=cfg.train, checkpoint=cfg.checkpoint, resolved=resolve(cfg), run_dir=run_dir,
                   dist_env=dist_env, device="cpu", config_yaml="model: {size: tiny}\n")
    return asdict(result)
