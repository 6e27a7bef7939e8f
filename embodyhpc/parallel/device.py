"""Which GPU a rank binds: the local rank's share of the GPUs its task sees (every GPU of the node, only its own, or
a share under partial binding), made current before anything touches CUDA. The training job's process group
(launch/distributed.py) and the training loop both bind through rank_device.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used
    import torch


def _count(environ: Mapping[str, str], name: str) -> int | None:
    """A non-negative count from a launcher's variable; None when unset or not a plain number (unknown)."""
    text = environ.get(name, "").strip()
    return int(text) if text.isascii() and text.isdigit() else None


def node_gpu_count(environ: Mapping[str, str], num_visible: int) -> int | None:
    """The GPUs the job has on this node, whatever each task is shown of them: the ids Slurm lists in
    SLURM_JOB_GPUS (set in the batch script, inherited by every task) or SLURM_STEP_GPUS; outside Slurm nothing
    binds GPUs to tasks, so what the task sees (`num_visible`); None under Slurm without GPU ids (unknown).
    SLURM_GPUS_ON_NODE is not read: with per-task binding it may count the task's GPUs only."""
    for name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        ids = [i for i in environ.get(name, "").split(",") if i.strip()]
        if ids:
            return len(ids)
    return None if "SLURM_JOB_ID" in environ else num_visible


def gpu_index(local_rank: int, num_visible: int, local_world_size: int | None,
              environ: Mapping[str, str] = os.environ) -> int:
    """Which of the `num_visible` GPUs this task sees is local rank `local_rank`'s, one GPU per rank:

    - every task sees the node's GPUs (torchrun; srun without GPU binding): cuda:<local rank>;
    - each task sees one (--gpus-per-task=1, --gpu-bind=single:1 or map_gpu): cuda:0;
    - each task sees k of them, shared by n/k tasks (--gpu-bind=closest: the GPUs of its NUMA node; k visible to
      each of n local tasks): cuda:<local rank % k>, which is one GPU each when the tasks sharing a set are
      consecutive local ranks (tasks laid out by block within the node, `--distribution=*:block`). Under
      another layout NCCL refuses the communicator ("Duplicate GPU detected"): bind one GPU per task instead.

    `local_world_size` (the tasks on this node) is None when unknown (then LOCAL_WORLD_SIZE, torchrun's, is read).
    Refused, with the fix: no GPU visible, more local ranks than the node's GPUs (node_gpu_count: ranks would share
    one), and k visible to n tasks where k does not divide n.
    """
    host = socket.gethostname()
    shown = environ.get("CUDA_VISIBLE_DEVICES")
    where = f"on {host}" + (f" (CUDA_VISIBLE_DEVICES={shown!r})" if shown is not None else "")
    if local_rank < 0:
        raise RuntimeError(f"local rank {local_rank} is negative {where} (fix: the launcher's SLURM_LOCALID or "
                           "LOCAL_RANK)")
    if num_visible <= 0:
        raise RuntimeError(f"local rank {local_rank} sees no GPU {where} (fix: request GPUs with "
                           "resources.gpus_per_node, and do not hide them: CUDA_VISIBLE_DEVICES empty, -1 or "
                           "NoDevFiles shows none)")
    tasks = local_world_size if local_world_size is not None else _count(environ, "LOCAL_WORLD_SIZE")
    if tasks is None:  # how many tasks share the node is unknown: one GPU each, or the only one shown
        if num_visible == 1 or local_rank < num_visible:
            return 0 if num_visible == 1 else local_rank
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own: torch sees {num_visible} {where} "
                           "(fix: resources.tasks_per_node must not exceed resources.gpus_per_node, and "
                           "CUDA_VISIBLE_DEVICES must not hide GPUs)")
    if not 0 <= local_rank < tasks:
        raise RuntimeError(f"local rank {local_rank} is outside the {tasks} tasks of {host} (fix: the launcher's "
                           "SLURM_LOCALID or LOCAL_RANK and its tasks per node disagree)")
    node_gpus = node_gpu_count(environ, num_visible)
    if node_gpus is not None and tasks > node_gpus:
        raise RuntimeError(f"{tasks} ranks share the {node_gpus} GPU(s) of {host} ({num_visible} visible to local "
                           f"rank {local_rank}); every rank needs a GPU of its own (fix: resources.tasks_per_node "
                           "<= resources.gpus_per_node)")
    if num_visible >= tasks:
        return local_rank
    if tasks % num_visible:
        raise RuntimeError(f"local rank {local_rank} sees {num_visible} GPUs {where}, which {tasks} tasks cannot "
                           "share one each (fix: bind one GPU per task, srun --gpus-per-task=1 or "
                           "--gpu-bind=single:1, or none, --gpu-bind=none)")
    return local_rank % num_visible


def rank_device(device: torch.device | str, local_rank: int, local_world_size: int | None = None) -> torch.device:
    """This rank's torch.device, made current: a bare "cuda" becomes the GPU gpu_index() gives this local rank,
    whether the task sees every GPU of the node, only its own, or a share of them (partial GPU binding).

    Call it before anything touches CUDA and before the process group exists: otherwise NCCL, the caching allocator,
    pinned-memory threads and the CUDA RNG of every rank of a node start on GPU 0.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", gpu_index(local_rank, torch.cuda.device_count(), local_world_size))
    torch.cuda.set_device(device)
    return device
