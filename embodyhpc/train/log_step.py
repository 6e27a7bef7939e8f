"""What one log step of the training loop reports, reduced over the ranks: every rank calls these at the same log
step (the condition depends only on the step), each runs its collectives, and only rank 0's sinks write the result
(train/metrics.py)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from embodyhpc.models.fp8 import FP8GemmCounter


def reduced_metrics(loss: torch.Tensor, grad_norm: float, lr: float, step_time_s: float, wait_s: float,
                     num_tokens: int, budget_tokens: int, samples_per_device: int, world_size: int,
                     device: torch.device, *, skipped_samples: int | None = None) -> dict[str, float]:
    """Mean loss, step time and data wait over ranks, total tokens (and packing budget): one all_reduce on every
    rank. `packing_efficiency` (useful tokens / the token budget of the packed micro-batches) is there only when
    the collate packs (the budget is 0 otherwise, and the same decision follows on every rank from the sums).
    `skipped_samples` (data.on_bad_sample=skip, the same choice on every rank): this rank's bad samples skipped so
    far, summed over ranks into `data_skipped_samples`."""
    skipped = [] if skipped_samples is None else [float(skipped_samples)]
    values = torch.tensor([float(loss), step_time_s, wait_s, float(num_tokens), float(budget_tokens), *skipped],
                          dtype=torch.float64)
    values = values.to(device)
    dist.all_reduce(values)
    loss_mean, step_time_mean, wait_mean, tokens_total, budget_total = (values[:5] / torch.tensor(
        [world_size, world_size, world_size, 1, 1], dtype=torch.float64, device=device)).tolist()
    metrics = {"loss": loss_mean, "lr": lr, "grad_norm": grad_norm, "step_time_s": step_time_mean,
               "samples_per_s_per_device": samples_per_device / step_time_mean,
               "tokens_per_s": tokens_total / step_time_mean,
               "data_wait_fraction": wait_mean / step_time_mean if step_time_mean > 0 else 0.0}
    if budget_total > 0:
        metrics["packing_efficiency"] = tokens_total / budget_total
    if skipped:
        metrics["data_skipped_samples"] = float(values[5])
    return metrics


def fp8_metrics(counter: FP8GemmCounter, steps: int) -> dict[str, float]:
    """fp8_gemms: forward GEMMs that ran in float8 per step on this rank (models/fp8.py FP8GemmCounter), averaged over
    the steps since the last log; fp8_gemms_fell_back: GEMMs of fp8 layers that ran in high precision (te layers
    outside te.autocast: should be 0). Nothing for a model without fp8 layers."""
    if counter.num_layers == 0:
        return {}
    fp8, fell_back = counter.take()
    return {"fp8_gemms": fp8 / max(steps, 1), "fp8_gemms_fell_back": fell_back / max(steps, 1)}


LOADER_METRICS = ("data_decode_ms_per_sample", "data_loader_samples_per_s")


def over_ranks(local: dict[str, float], device: Any) -> dict[str, float]:
    """The loader metrics of every rank as the run's: decode ms per sample averaged over the ranks that delivered
    a batch since the last log, loader samples/s summed over them (every rank's workers feed its own training).
    One all_reduce of 3 numbers, called by every rank at the same log step; {} when no rank had a batch."""
    has = all(name in local for name in LOADER_METRICS)
    values = torch.tensor([float(has), *(local[name] if has else 0.0 for name in LOADER_METRICS)],
                          dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(values)
    ranks, decode_ms, samples_per_s = values.tolist()
    if ranks <= 0:
        return {}
    return {"data_decode_ms_per_sample": decode_ms / ranks, "data_loader_samples_per_s": samples_per_s}
