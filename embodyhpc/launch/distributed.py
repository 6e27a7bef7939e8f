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
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used, as in the rest of the launcher (no torch at import)
    import torch

from embodyhpc.rundir import flight_recorder_prefix

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

    @property
    def local_world_size(self) -> int:
        """The tasks on each node (the recipe's resources.tasks_per_node: every node runs as many)."""
        return self.world_size // max(self.num_nodes, 1)


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


def export_rank_env(dist_env: DistEnv) -> None:
    """The torchrun variables, so that libraries reading them (DeviceMesh's device fallback, transformer-engine) see
    the ranks this job derived from Slurm, not stale values inherited from the submitting shell."""
    os.environ.update(RANK=str(dist_env.rank), LOCAL_RANK=str(dist_env.local_rank),
                      WORLD_SIZE=str(dist_env.world_size), MASTER_ADDR=dist_env.master_addr,
                      MASTER_PORT=str(dist_env.master_port))


@contextlib.contextmanager
def process_group(dist_env: DistEnv, backend: str = "gloo", timeout_s: float = 300.0,
                  device: torch.device | str = "cpu", run_dir: str | os.PathLike | None = None
                  ) -> Iterator[torch.device]:
    """init_process_group over TCP from DistEnv; barrier before teardown (see FACTS: gloo at exit).

    The flight recorder's size is set first, under the name this torch reads (set_flight_recorder_size), and with
    `run_dir` where it dumps: logs/flight-recorder/<job id>/ of the run (set_flight_recorder_dump_file; both in
    parallel/flight_recorder.py). Yields this rank's device (parallel/device.py's rank_device): on a GPU it is current
    before the group exists and the group is bound to it (`device_id`), so NCCL's communicator and the teardown
    barrier use this rank's GPU.
    """
    import torch
    import torch.distributed as dist

    # here, not at the top: importing embodyhpc.parallel imports torch
    from embodyhpc.parallel.device import rank_device
    from embodyhpc.parallel.flight_recorder import set_flight_recorder_dump_file, set_flight_recorder_size

    set_flight_recorder_size(os.environ, torch.__version__)
    if run_dir is not None:
        set_flight_recorder_dump_file(os.environ, torch.__version__,
                                      flight_recorder_prefix(Path(run_dir), dist_env.job_id))
    bound = rank_device(device, dist_env.local_rank, dist_env.local_world_size)
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
