"""Distributed set-up inside a job: who am I, where is rank 0, and a process group with timeouts.

Works under Slurm (srun tasks) and under submitit's local executor (processes on this machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import zlib
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used, as in the rest of the launcher (no torch at import)
    import torch

from embodyhpc.config.nccl_values import FLIGHT_RECORDER_NAMES
from embodyhpc.rundir import flight_recorder_prefix

PORT_BASE = 20000
PORT_SPAN = 20000

# The flight recorder's size. torch 2.8 renamed TORCH_NCCL_TRACE_BUFFER_SIZE to TORCH_FR_BUFFER_SIZE; it still
# reads the old name but then every rank prints a deprecation warning, and a torch before 2.8 knows only the old
# one. The nodes' torch is known only in the job, so the job, not the sbatch script, exports it.
FR_BUFFER_NEW, FR_BUFFER_OLD = FLIGHT_RECORDER_NAMES
FR_RENAMED_IN = (2, 8)
FR_DEFAULT_ENTRIES = 2000  # what torch's flight-recorder tutorial recommends
# Where it dumps (a file-name prefix, torch appends the rank). Renamed like the size; torch reads the old name in
# every version (newer ones warn on each rank) and the new one surely from 2.9 (torchtitan switches there too), so
# the job switches at 2.9: at worst one warning per rank on 2.8, never a dump that goes to torch's default place.
FR_DUMP_NEW, FR_DUMP_OLD = "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FR_DUMP_RENAMED_IN = (2, 9)
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


def _torch_minor(torch_version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    if match is None:
        raise ValueError(f"not a torch version: {torch_version!r}")
    return int(match[1]), int(match[2])


def flight_recorder_variable(torch_version: str) -> str:
    """The name the given torch reads the flight recorder's size from without a warning."""
    return FR_BUFFER_NEW if _torch_minor(torch_version) >= FR_RENAMED_IN else FR_BUFFER_OLD


def flight_recorder_dump_variable(torch_version: str) -> str:
    """The name the given torch reads the flight recorder's dump-file prefix from."""
    return FR_DUMP_NEW if _torch_minor(torch_version) >= FR_DUMP_RENAMED_IN else FR_DUMP_OLD


def set_flight_recorder_dump_file(environ: MutableMapping[str, str], torch_version: str, prefix: Path) -> str:
    """Leave one flight-recorder dump prefix in `environ`, under the name `torch_version` reads; return that name.

    A prefix the user set (extra_env, site.env, the shell) is kept, translated when it came under the other name;
    with both names set, the value torch itself would have used wins. Without one (or an empty one, which would dump
    into the working directory), `prefix`: the run directory's (rundir.flight_recorder_prefix), its folder created,
    so that a hang's traces survive the job instead of staying in the node's /tmp or the home cache.
    """
    name = flight_recorder_dump_variable(torch_version)
    other = FR_DUMP_OLD if name == FR_DUMP_NEW else FR_DUMP_NEW
    value = environ.get(name, environ.get(other))
    environ.pop(other, None)
    if not value:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)  # torch opens the file, it makes no folder
        value = str(prefix)
    environ[name] = value
    return name


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
    `run_dir` where it dumps: logs/flight-recorder/<job id>/ of the run (set_flight_recorder_dump_file).
    Yields this rank's device (rank_device): on a GPU it is current before the group exists and the group is bound
    to it (`device_id`), so NCCL's communicator and the teardown barrier use this rank's GPU.
    """
    import torch
    import torch.distributed as dist

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
