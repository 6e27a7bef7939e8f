"""The training job's entry point (every rank runs `train_task`).

Until the FSDP2 trainer lands, the loop trains a real data-parallel least-squares model: each
rank draws its own batches, gradients are averaged with all_reduce over gloo, and progress is
checkpointed so a requeued job resumes where it stopped. That exercises what the spine needs
for real: rank discovery across nodes, rendezvous, collectives, the run directory, requeue.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from embodyhpc.config.load import load_resolved
from embodyhpc.config.schema import CheckpointConfig, DataConfig, StagingConfig, TrainConfig
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
    config = load_resolved(run_dir)
    dist_env = distributed.from_job_environment()
    data_root = prepare_data(config.data, config.staging, dist_env.local_rank)
    dataset_len = None
    if data_root is not None:  # every rank reads from the copy it will train on
        from embodyhpc.data import open_dataset

        dataset = open_dataset(data_root, dict(config.data.delta_timestamps) or None)
        dataset_len = len(dataset)
        dataset[dist_env.rank % dataset_len]
    with distributed.process_group(dist_env, backend="gloo"):
        result = _spine_loop(dist_env, config.train, config.checkpoint, Path(run_dir))
    result.update(data_root=data_root, dataset_len=dataset_len)
    if dist_env.rank == 0:
        write_json_atomic(Path(run_dir) / RESULT_FILE, result)
    return result


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
    hostnames = _gather_hostnames(world)

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
        "world_size": world,
        "allreduce_sum": probe.item(),
        "allreduce_expected": world * (world + 1) / 2,
        "hostnames": hostnames,
        "job_id": dist_env.job_id,
        "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        "resumed_from_step": start_step,
        "steps": train.steps,
        "final_loss": float(loss.item()),
        "weight_error": float((weights - true_w).norm().item()),
        "loop_s": time.monotonic() - t0,
    }
