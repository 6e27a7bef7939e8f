"""The training job's entry point (every rank runs `train_task`).

With a dataset (`data.format` lerobot or hdf5) the job stages it to node-local storage when asked, then
trains the recipe's policy with the FSDP2 loop of embodyhpc.train (DCP checkpoints, resume, export).
With `data.format: synthetic` it runs a small real stand-in instead: a data-parallel least-squares model
whose gradients are averaged with all_reduce over gloo and whose progress is checkpointed, so the launch
path (rank discovery across nodes, rendezvous, collectives, requeue and resume) is exercised in seconds.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from embodyhpc.config.load import load_resolved
from embodyhpc.config.schema import CheckpointConfig, Config, DataConfig, StagingConfig, TrainConfig
from embodyhpc.launch import distributed
from embodyhpc.rundir import write_json_atomic

RESULT_FILE = "logs/train_result.json"
STATE_FILE = "checkpoints/spine-state.pt"
_DIM = 16
_HOST_BYTES = 64


def prepare_data(data: DataConfig, staging: StagingConfig, local_rank: int) -> str | None:
    """The folder training reads: the node-local staged copy when staging is on (local rank 0 of each
    node copies, the other local ranks wait), else data.root. Runs before the process group exists."""
    if data.format == "synthetic":
        return None
    root = Path(str(data.root))
    if not root.exists():
        raise FileNotFoundError(f"data.root {data.root!r} does not exist on {socket.gethostname()}")
    if not staging.enabled:
        return str(root)
    from embodyhpc.data.staging import node_local_path, stage_on_node

    dest = node_local_path(staging.nvme_dir, root)
    stage_on_node(root, dest, local_rank=local_rank, workers=staging.copy_workers, verify=staging.verify,
                  progress=False)
    return str(dest)


def train_task(run_dir: str) -> dict:
    """Every rank: stage data, join the process group, train, and (rank 0) write the result file.

    A recipe with a dataset trains its policy with the FSDP2 loop (embodyhpc.train); `data.format: synthetic`
    runs the small data-parallel stand-in below, which exercises the same launch path in seconds.
    """
    config = load_resolved(run_dir)
    dist_env = distributed.from_job_environment()
    data_root = prepare_data(config.data, config.staging, dist_env.local_rank)
    with distributed.process_group(dist_env, backend="gloo"):
        hostnames = _gather_hostnames(dist_env.world_size)
        if data_root is None:
            result = _spine_loop(dist_env, config.train, config.checkpoint, Path(run_dir))
        else:
            result = _train_policy(config, Path(run_dir), data_root, dist_env)
    result.update(data_root=data_root, hostnames=hostnames, world_size=dist_env.world_size,
                  restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0")), job_id=dist_env.job_id)
    if dist_env.rank == 0:
        write_json_atomic(Path(run_dir) / RESULT_FILE, result)
    return result


def _train_policy(config: Config, run_dir: Path, data_root: str, dist_env: distributed.DistEnv) -> dict:
    import dataclasses

    from embodyhpc.config.resolve import resolve
    from embodyhpc.rundir import RESOLVED_YAML
    from embodyhpc.train.loop import train

    out = train(data=dataclasses.replace(config.data, root=data_root), model_cfg=config.model,
                precision=config.precision, parallelism=config.parallelism, train_cfg=config.train,
                checkpoint=config.checkpoint, resolved=resolve(config), run_dir=run_dir, dist_env=dist_env,
                device="cpu", config_yaml=(run_dir / RESOLVED_YAML).read_text())
    return {"mode": "policy", "resumed_from_step": out.start_step, "steps": out.final_step,
            "last_metrics": out.last_metrics, "export_path": str(out.export_path) if out.export_path else None}


def _gather_hostnames(world: int) -> list[str]:
    """all_gather of fixed-size byte tensors (all_gather_object would need numpy)."""
    import torch
    import torch.distributed as dist

    mine = torch.zeros(_HOST_BYTES, dtype=torch.uint8)
    raw = socket.gethostname().encode()[:_HOST_BYTES]
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [bytes(t.tolist()).rstrip(b"\0").decode() for t in gathered]


def _spine_loop(dist_env: distributed.DistEnv, train: TrainConfig, ckpt: CheckpointConfig,
                run_dir: Path) -> dict:
    import torch
    import torch.distributed as dist

    world, rank = dist_env.world_size, dist_env.rank
    # every rank proves it can reach every other: sum of (rank + 1) and all host names
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)

    true_w = torch.randn(_DIM, generator=torch.Generator().manual_seed(train.seed))
    weights = torch.zeros(_DIM)
    start_step = 0
    state_path = run_dir / STATE_FILE
    if state_path.exists():  # resume after requeue: rank 0 reads, everyone receives the same
        state = torch.load(state_path) if rank == 0 else {"step": 0, "weights": weights}
        weights, start_step = state["weights"], int(state["step"])
    header = torch.cat([torch.tensor([float(start_step)]), weights])
    dist.broadcast(header, src=0)
    start_step, weights = int(header[0].item()), header[1:].clone()

    per_rank = max(train.global_batch_size // world, 1)
    t0 = time.monotonic()
    loss = torch.tensor(0.0)
    for step in range(start_step, train.steps):
        gen = torch.Generator().manual_seed(train.seed * 1_000_003 + step * world + rank)
        x = torch.randn(per_rank, _DIM, generator=gen)
        y = x @ true_w
        err = x @ weights - y
        grad = 2 * x.T @ err / per_rank
        stats = torch.cat([grad, (err.pow(2).mean()).reshape(1)])
        dist.all_reduce(stats)
        stats /= world
        lr = train.lr * min(1.0, (step + 1) / max(train.warmup_steps, 1))
        weights -= lr * stats[:-1]
        loss = stats[-1]
        if rank == 0 and (step + 1) % ckpt.every_steps == 0 and step + 1 < train.steps:
            tmp = state_path.with_suffix(".tmp")
            torch.save({"step": step + 1, "weights": weights}, tmp)
            os.replace(tmp, state_path)
        if rank == 0 and (step + 1) % train.log_every == 0:
            print(f"step {step + 1}/{train.steps} loss {loss.item():.6f}", flush=True)
    return {
        "mode": "spine",
        "allreduce_sum": probe.item(),
        "allreduce_expected": world * (world + 1) / 2,
        "resumed_from_step": start_step,
        "steps": train.steps,
        "final_loss": float(loss.item()),
        "weight_error": float((weights - true_w).norm().item()),
        "loop_s": time.monotonic() - t0,
    }
