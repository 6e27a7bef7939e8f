"""Distributed wrapping of models: the device mesh, activation checkpointing, per-block compile, FSDP2.

The only package that wraps modules for FSDP; models declare their wrap units (`fsdp_units()`) and never import
torch.distributed. Usage on every rank, after init_process_group:

    resolved = resolve(config)
    mesh = build_mesh(resolved.dp_replicate, resolved.dp_shard, "cuda" or "cpu")
    with torch.device("meta"):
        model = build_model(config.model, config.precision)
    plan = parallelize(model, config.parallelism, config.precision, mesh)
    materialize(model, device)

Before the process group exists: device.rank_device (the GPU each rank binds) and flight_recorder (the NCCL flight
recorder's settings under the names the running torch reads); the job's process group (launch/distributed.py), the
training loop and `embodyhpc smoke` use them.
"""

from __future__ import annotations

from embodyhpc.parallel.mesh import REPLICATE_DIM, SHARD_DIM, build_mesh, mesh_degrees
from embodyhpc.parallel.parallelize import materialize, parallelize
from embodyhpc.parallel.plan import ParallelPlan, declared_units, make_plan
from embodyhpc.parallel.precision import mixed_precision_policy, precompute_fp8_scales

__all__ = ["REPLICATE_DIM", "SHARD_DIM", "ParallelPlan", "build_mesh", "declared_units", "make_plan", "materialize",
           "mesh_degrees", "mixed_precision_policy", "parallelize", "precompute_fp8_scales"]
