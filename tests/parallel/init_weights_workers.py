"""Rank jobs for tests/train/test_init_weights.py (module-level, so spawned ranks import them by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from embodyhpc.checkpoint.sliced_weights import ReadStats, load_weights_sharded
from embodyhpc.config.schema import ParallelismConfig
from embodyhpc.models.pi05.weights import ADAPTER
from embodyhpc.parallel import build_mesh
from tests.models.conftest import make_batch
from tests.parallel.workers import MODEL, PER_RANK, build_sharded, local_params, step_data


def load_and_loss(rank: int, world: int, path: str) -> dict:
    """Meta build -> FSDP2 -> materialize (random) -> the checkpoint by slices; the global loss of step 0's batch."""
    model, _ = build_sharded(build_mesh(1, world, "cpu"), ParallelismConfig())
    stats = ReadStats()
    report = load_weights_sharded(model, path, ADAPTER, stats=stats)
    params = local_params(model)  # before the forward: the root unit stays unsharded after it
    samples, noise, flow_time = step_data(0, PER_RANK * world)
    lo, hi = rank * PER_RANK, (rank + 1) * PER_RANK
    with torch.no_grad():
        loss = model(make_batch(MODEL, samples[lo:hi]), noise=noise[lo:hi], time=flow_time[lo:hi]).loss
    dist.all_reduce(loss)
    return {"loss": (loss / world).item(), "ok": report.ok, "bytes_read": stats.bytes_read,
            "largest_read": stats.largest_read, "params": params}


def refused(rank: int, world: int, path: str) -> str:
    model, _ = build_sharded(build_mesh(1, world, "cpu"), ParallelismConfig())
    try:
        load_weights_sharded(model, path, ADAPTER)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "loaded"
