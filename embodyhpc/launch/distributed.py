"""Distributed set-up inside a job: who am I, where is rank 0, and a process group with timeouts.

Works under Slurm (srun tasks) and under submitit's local executor (processes on this machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import zlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used, as in the rest of the launcher (no torch at import)
    import torch

from embodyhpc.config.nccl_values import FLIGHT_RECORDER_NAMES

PORT_BASE = 20000
PORT_SPAN = 20000

# The flight recorder's size. torch 2.8 renamed TORCH_NCCL_TRACE_BUFFER_SIZE to TORCH_FR_BUFFER_SIZE; it still
# reads the old name but then every rank prints a deprecation warning, and a torch before 2.8 knows only the old
# one. The nodes' torch is known only in the job, so the job, not the sbatch script, exports it.
FR_BUFFER_NEW, FR_BUFFER_OLD = FLIGHT_RECORDER_NAMES
FR_RENAMED_IN = (2, 8)
FR_DEFAULT_ENTRIES = 2000  # what torch's flight-recorder tutorial recommends
_TRUE = ("1", "true", "t", "yes", "y")  # what torch's getCvarBool takes as true


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    job_id: str
    hostnames: tuple[str, ...]


def port_for_job(job_id: str) -> int:
    """A rendezvous port every rank derives alike; jobs sharing a node rarely collide."""
    digits = re.sub(r"\D", "", job_id)
    key = int(digits) if digits else zlib.crc32(job_id.encode())
    return PORT_BASE + key % PORT_SPAN


def from_job_environment() -> DistEnv:
    import submitit

    env = submitit.JobEnvironment()
    hostnames = tuple(env.hostnames)
    local = os.environ.get("SUBMITIT_EXECUTOR") == "local"
    return DistEnv(
        rank=env.global_rank,
        local_rank=env.local_rank,
        world_size=env.num_tasks,
        node_rank=env.node,
        num_nodes=env.num_nodes,
        master_addr="127.0.0.1" if local else hostnames[0],
        master_port=port_for_job(str(env.job_id)),
        job_id=str(env.job_id),
        hostnames=hostnames,
    )


def flight_recorder_variable(torch_version: str) -> str:
    """The name the given torch reads the flight recorder's size from without a warning."""
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    if match is None:
        raise ValueError(f"not a torch version: {torch_version!r}")
    return FR_BUFFER_NEW if (int(match[1]), int(match[2])) >= FR_RENAMED_IN else FR_BUFFER_OLD


def set_flight_recorder_size(environ: MutableMapping[str, str], torch_version: str) -> str | None:
    """Leave at most one flight-recorder size in `environ`, under the name `torch_version` reads; return that name.

    A size the user set is kept, translated when it came under the other name; with both names set, the value
    torch itself would have used wins (the new name on torch >= 2.8, the old one before). Without any, dumps on
    timeout (TORCH_NCCL_DUMP_ON_TIMEOUT, from network.dump_on_timeout) get FR_DEFAULT_ENTRIES entries to dump.
    """
    name = flight_recorder_variable(torch_version)
    other = FR_BUFFER_OLD if name == FR_BUFFER_NEW else FR_BUFFER_NEW
    value = environ.get(name, environ.get(other))
    environ.pop(other, None)
    if value is None and environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").strip().lower() in _TRUE:
        value = str(FR_DEFAULT_ENTRIES)
    if value is None:
        return None
    environ[name] = value
    return name


def rank_device(device: torch.device | str, local_rank: int) -> torch.device:
    """This rank's torch.device, made current: a bare "cuda" becomes the GPU of its local rank (one GPU per local
    rank), or the only GPU when the job shows each task just its own (Slurm's per-task GPU binding).

    Call it before anything touches CUDA and before the process group exists: otherwise NCCL, the caching allocator,
    pinned-memory threads and the CUDA RNG of every rank of a node start on GPU 0.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device
    if device.index is None:
        count = torch.cuda.device_count()
        index = 0 if count == 1 else local_rank
        if index >= count:
            raise RuntimeError(f"local rank {local_rank} has no GPU of its own: torch sees {count} on "
                               f"{socket.gethostname()} (resources.tasks_per_node must not exceed "
                               "resources.gpus_per_node, and CUDA_VISIBLE_DEVICES must not hide GPUs)")
        device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def export_rank_env(dist_env: DistEnv) -> None:
    """The torchrun variables, so that libraries reading them (DeviceMesh's device fallback, transformer-engine) see
    the ranks this job derived from Slurm, not stale values inherited from the submitting shell."""
    os.environ.update(RANK=str(dist_env.rank), LOCAL_RANK=str(dist_env.local_rank),
                      WORLD_SIZE=str(dist_env.world_size), MASTER_ADDR=dist_env.master_addr,
                      MASTER_PORT=str(dist_env.master_port))


@contextlib.contextmanager
def process_group(dist_env: DistEnv, backend: str = "gloo", timeout_s: float = 300.0,
                  device: torch.device | str = "cpu") -> Iterator[torch.device]:
    """init_process_group over TCP from DistEnv; barrier before teardown (see FACTS: gloo at exit).

    The flight recorder's size is set first, under the name this torch reads (set_flight_recorder_size).
    Yields this rank's device (rank_device): on a GPU it is current before the group exists and the group is bound
    to it (`device_id`), so NCCL's communicator and the teardown barrier use this rank's GPU.
    """
    import torch
    import torch.distributed as dist

    set_flight_recorder_size(os.environ, torch.__version__)
    bound = rank_device(device, dist_env.local_rank)
    export_rank_env(dist_env)
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{dist_env.master_addr}:{dist_env.master_port}",
        rank=dist_env.rank,
        world_size=dist_env.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=bound if bound.type == "cuda" else None,
    )
    try:
        yield bound
        dist.barrier()
    finally:
        dist.destroy_process_group()
