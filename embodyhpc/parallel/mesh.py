"""The data-parallel device mesh: plain FSDP (1-D) or HSDP (2-D, replicate across nodes, shard within a node).

Rank layout assumption: ranks of one node are consecutive (node n holds ranks n*P .. n*P + P - 1 for P processes
per node), which is how srun and torchrun number them. `init_device_mesh` fills the mesh row-major, so with the
shape (dp_replicate, dp_shard) the shard groups are runs of dp_shard consecutive ranks and the replicate groups
are strided. A shard group therefore covers whole nodes exactly when dp_shard is a multiple of the processes per
node: then the all-gathers and reduce-scatters of every step stay on the node's fast links (NVLink) and only the
gradient all-reduce between replicas crosses the network, the reason HSDP is the usual choice on InfiniBand.

The degrees come from `embodyhpc.config.resolve.resolve` (the one place they meet the world size); this module
only checks that the live process group agrees with them.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from embodyhpc.errors import ConfigError

SHARD_DIM = "dp_shard"
REPLICATE_DIM = "dp_replicate"


def build_mesh(dp_replicate: int, dp_shard: int, device_type: str, *, procs_per_node: int | None = None
               ) -> DeviceMesh:
    """A mesh ("dp_shard",) when dp_replicate == 1, else ("dp_replicate", "dp_shard") of that shape.

    dp_replicate and dp_shard are the resolved degrees (`Resolved.dp_replicate`, `Resolved.dp_shard`; never -1).
    With procs_per_node, HSDP refuses shard groups that would split a node (see the module doc). Needs an
    initialised default process group; every rank must call it (creating sub-groups is collective).
    """
    degrees = (f"parallelism.dp_replicate={dp_replicate}, parallelism.dp_shard={dp_shard}, "
               f"device_type={device_type!r}")
    if dp_replicate < 1 or dp_shard < 1:
        raise ValueError(f"build_mesh takes resolved degrees (>= 1), got {degrees}: "
                         "pass embodyhpc.config.resolve.resolve(config).dp_replicate / .dp_shard")
    if not dist.is_initialized():
        raise RuntimeError(f"build_mesh needs an initialised process group ({degrees}); "
                           "call torch.distributed.init_process_group first (launch/distributed does)")
    world_size = dist.get_world_size()
    degrees += f", world_size={world_size}"
    if dp_replicate * dp_shard != world_size:
        # resolve() already guarantees this for the recipe's world size; a mismatch means the job runs with
        # another number of processes than the recipe resolved for (e.g. srun -n overridden by hand)
        raise ConfigError(f"dp_replicate x dp_shard does not match the running world size: {degrees}",
                          key="parallelism.dp_shard", related=("parallelism.dp_replicate", "resources.nodes"),
                          fix="launch as many processes as the recipe resolves to, or set parallelism.dp_shard=-1")
    if dp_replicate > 1 and procs_per_node and dp_shard % procs_per_node:
        raise ConfigError(
            f"HSDP shard groups of {dp_shard} consecutive ranks would split nodes of {procs_per_node} processes "
            f"(the ranks of one node must share a shard group): {degrees}",
            key="parallelism.dp_shard", related=("parallelism.dp_replicate", "resources.tasks_per_node"),
            fix=f"use a multiple of {procs_per_node} for parallelism.dp_shard (usually {procs_per_node}), "
            "or dp_replicate=1 for plain FSDP")
    if dp_replicate == 1:
        return init_device_mesh(device_type, (dp_shard,), mesh_dim_names=(SHARD_DIM,))
    return init_device_mesh(device_type, (dp_replicate, dp_shard), mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))


def mesh_degrees(mesh: DeviceMesh) -> tuple[int, int]:
    """(dp_replicate, dp_shard) of a mesh made by build_mesh; refuses meshes with other dimensions."""
    names = tuple(mesh.mesh_dim_names or ())
    if names == (SHARD_DIM,):
        return 1, mesh.size(0)
    if names == (REPLICATE_DIM, SHARD_DIM):
        return mesh.size(0), mesh.size(1)
    raise ValueError(f"expected a mesh with dims ({SHARD_DIM!r},) or ({REPLICATE_DIM!r}, {SHARD_DIM!r}) "
                     f"from embodyhpc.parallel.build_mesh, got {names}")
