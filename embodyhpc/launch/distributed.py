"""Distributed set-up inside a job: who am I, where is rank 0, and a process group with timeouts.

Works under Slurm (srun tasks) and under submitit's local executor (processes on this machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

PORT_BASE = 20000
PORT_SPAN = 20000


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


@contextlib.contextmanager
def process_group(dist_env: DistEnv, backend: str = "gloo", timeout_s: float = 300.0) -> Iterator[None]:
    """init_process_group over TCP from DistEnv; barrier before teardown (see FACTS: gloo at exit)."""
    import torch.distributed as dist

    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{dist_env.master_addr}:{dist_env.master_port}",
        rank=dist_env.rank,
        world_size=dist_env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
