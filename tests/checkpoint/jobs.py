"""What each rank runs in the multi-rank checkpoint tests (spawned through distributed.run_ranks).

Each job writes its findings under `out` from rank 0 (torch.save / JSON); the tests assert on those files.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch

from embodyhpc.checkpoint import Checkpointer, layout
from embodyhpc.config.schema import CheckpointConfig
from tests.checkpoint.distributed import (
    ToySampler,
    full_state,
    scheduler_for,
    seed_all,
    sharded_model,
    train_step,
)

CONFIG_YAML = "model:\n  name: pi05\n  size: tiny\n  action_horizon: 8\n  action_dim: 8\n"
NUM_RESUME_STEPS, RESUME_SAVE_EVERY = 6, 3


def save_job(rank: int, world_size: int, out: str) -> None:
    """Train 2 steps; async-save step 2 while step 3 trains; sync-save step 3; export. Keep the full states."""
    out_dir = Path(out)
    ckpt = Checkpointer(out_dir / "checkpoints", CheckpointConfig(every_steps=1, keep_latest_k=2, async_save=True))
    seed_all(100 + rank)
    model, optimizer = sharded_model(init_seed=0)
    scheduler, sampler = scheduler_for(optimizer), ToySampler(rank, world_size)
    for _ in range(2):
        train_step(model, optimizer, scheduler, sampler)
    expected_2 = full_state(model, optimizer)

    def extra() -> dict:
        return {"scheduler": scheduler.state_dict()}

    async_result = ckpt.save(2, model, optimizer, sampler_state=sampler.state_dict(), extra=extra())
    marker_at_return = layout.is_complete(async_result.folder)
    # Step 3 runs FSDP's all-gathers on the default group while DCP works on the checkpoint group, and changes
    # the parameters under the save: what step-2 holds must still be the step-2 values.
    train_step(model, optimizer, scheduler, sampler)
    wait_s = ckpt.wait()
    expected_3 = full_state(model, optimizer)
    sync_result = ckpt.save(3, model, optimizer, sampler_state=sampler.state_dict(), extra=extra(), blocking=True)
    start = time.perf_counter()
    weights = ckpt.export(out_dir / "export", config_yaml=CONFIG_YAML)
    export_s = time.perf_counter() - start
    ckpt.close()
    if rank == 0:
        torch.save({2: expected_2, 3: expected_3}, out_dir / "expected.pt")
        (out_dir / "save_job.json").write_text(json.dumps({
            "async_stall_s": async_result.stall_s, "async_is_async": async_result.is_async,
            "marker_at_return": marker_at_return, "wait_s": wait_s, "sync_stall_s": sync_result.stall_s,
            "export_s": export_s, "weights": str(weights)}))


def load_job(rank: int, world_size: int, out: str) -> None:
    """Load the save job's checkpoints into a differently initialised model on `world_size` ranks; train on."""
    out_dir = Path(out)
    ckpt = Checkpointer(out_dir / "checkpoints", CheckpointConfig(every_steps=1, keep_latest_k=2), seed=5)
    seed_all(999 + rank)
    model, optimizer = sharded_model(init_seed=1234)
    scheduler, sampler = scheduler_for(optimizer), ToySampler(rank, world_size)
    start = time.perf_counter()
    latest = ckpt.load_latest(model, optimizer)
    load_s = time.perf_counter() - start
    loaded_3 = full_state(model, optimizer)
    ckpt.load(2, model, optimizer)
    loaded_2 = full_state(model, optimizer)
    sampler.load_state_dict(latest.trainer.sampler)
    scheduler.load_state_dict(latest.trainer.extra["scheduler"])
    loss = train_step(model, optimizer, scheduler, sampler)  # training goes on at the new world size
    ckpt.close()
    if rank == 0:
        torch.save({2: loaded_2, 3: loaded_3, "step": latest.step, "saved_world_size": latest.saved_world_size,
                    "rng_restored": latest.rng_restored, "loss_after": loss, "load_s": load_s},
                   out_dir / f"loaded_w{world_size}.pt")


def resume_first_job(rank: int, world_size: int, out: str) -> None:
    """An uninterrupted run of NUM_RESUME_STEPS, then the same run again that saves every RESUME_SAVE_EVERY steps
    and dies after step RESUME_SAVE_EVERY + 1 (that step's work is lost)."""
    out_dir = Path(out)
    seed_all(100 + rank)
    model, optimizer = sharded_model(init_seed=0)
    scheduler, sampler = scheduler_for(optimizer), ToySampler(rank, world_size)
    uninterrupted = [train_step(model, optimizer, scheduler, sampler) for _ in range(NUM_RESUME_STEPS)]

    cfg = CheckpointConfig(every_steps=RESUME_SAVE_EVERY, keep_latest_k=2, async_save=True)
    ckpt = Checkpointer(out_dir / "checkpoints", cfg)
    seed_all(100 + rank)
    model, optimizer = sharded_model(init_seed=0)
    scheduler, sampler = scheduler_for(optimizer), ToySampler(rank, world_size)
    interrupted = []
    for step in range(1, RESUME_SAVE_EVERY + 2):
        interrupted.append(train_step(model, optimizer, scheduler, sampler))
        if ckpt.due(step):
            ckpt.save(step, model, optimizer, sampler_state=sampler.state_dict(),
                      extra={"scheduler": scheduler.state_dict()})
    ckpt.close()
    if rank == 0:
        (out_dir / "first.json").write_text(json.dumps({"uninterrupted": uninterrupted, "interrupted": interrupted}))


def resume_second_job(rank: int, world_size: int, out: str) -> None:
    """A fresh job (other init, other seeds) that resumes from the newest complete checkpoint and finishes."""
    out_dir = Path(out)
    cfg = CheckpointConfig(every_steps=RESUME_SAVE_EVERY, keep_latest_k=2, async_save=True)
    ckpt = Checkpointer(out_dir / "checkpoints", cfg)
    seed_all(12345 + rank)
    model, optimizer = sharded_model(init_seed=4321)
    scheduler, sampler = scheduler_for(optimizer), ToySampler(rank, world_size)
    loaded = ckpt.load_latest(model, optimizer)
    sampler.load_state_dict(loaded.trainer.sampler)
    scheduler.load_state_dict(loaded.trainer.extra["scheduler"])
    resumed = [train_step(model, optimizer, scheduler, sampler) for _ in range(loaded.step + 1, NUM_RESUME_STEPS + 1)]
    ckpt.close()
    if rank == 0:
        (out_dir / "second.json").write_text(json.dumps({"step": loaded.step, "rng_restored": loaded.rng_restored,
                                                         "resumed": resumed}))


def killed_during_async_save_job(rank: int, world_size: int, out: str) -> None:
    """Save step 1; then rank 1 is SIGKILLed inside its DCP write of step 2 (the job dies with it)."""
    cfg = CheckpointConfig(every_steps=1, keep_latest_k=2, async_save=True)
    ckpt = Checkpointer(Path(out) / "checkpoints", cfg, collective_timeout_s=30)
    seed_all(100 + rank)
    model, optimizer = sharded_model(init_seed=0)
    scheduler, sampler = scheduler_for(optimizer), ToySampler(rank, world_size)
    train_step(model, optimizer, scheduler, sampler)
    ckpt.save(1, model, optimizer, sampler_state=sampler.state_dict(), blocking=True)
    train_step(model, optimizer, scheduler, sampler)
    if rank == 1:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = die  # runs in DCP's background thread, after the plans were exchanged
    ckpt.save(2, model, optimizer, sampler_state=sampler.state_dict())
    train_step(model, optimizer, scheduler, sampler)
    ckpt.wait()  # rank 0: fails (its peer is gone) or is terminated by the launcher first
