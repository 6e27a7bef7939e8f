"""What model.lora saves: trainable parameters, optimizer-state bytes and step time, LoRA against full fine-tuning.

    python bench/lora_cost.py                    # ~1 min: full sizes on the meta device, the tiny pi0.5 on the CPU
    python bench/lora_cost.py --world 8 --steps 20

Counts, at the full sizes (pi0.5 full with openpi's presets: rank 16 on the PaliGemma backbone, as gemma_2b_lora,
and the action expert; GR00T full with its default, the action head's attention at rank 32, alpha 16), on the meta
device (no memory, no weights): the model as training builds it, with and without adapters. Printed: trainable
parameters, AdamW's state (two fp32 moments per trainable parameter; LoRA gives the frozen base none) and the fp32
gradients, per rank under FSDP2 on --world ranks, and the ratio full / LoRA. The frozen base weights are held either
way and are printed once.

Step time, at the tiny size on the CPU (one process, one thread): a training step (forward, backward, AdamW,
zero_grad) of the tiny pi0.5 with full fine-tuning and with adapters (the default presets at rank 16), interleaved step
by step in one process so drift and the machine's load hit both alike, medians over --steps pairs; printed with the
load average. There is no goal: for the record (on a tiny model the base's forward and the activations' backward
dominate, and LoRA adds two small GEMMs per adapted layer: the ratio is not what a full-size GPU step shows). Always
exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pi05_common import ACTION_DIM, HORIZON, pi05_batches  # noqa: E402

GIB = 1024**3


def _configs(name: str, size: str):
    from embodyhpc.config.lora_schema import LoraConfig
    from embodyhpc.config.schema import ModelConfig

    lora = LoraConfig(rank=16, alpha=16.0) if name == "pi05" else LoraConfig(rank=32, alpha=16.0)
    extra = dict(action_horizon=HORIZON, action_dim=ACTION_DIM, max_token_len=160) if size == "tiny" else {}
    full = ModelConfig(name=name, size=size, **extra)
    return full, dataclasses.replace(full, lora=lora)


def counts(world: int) -> None:
    from embodyhpc.models import build_model
    from embodyhpc.models.lora import lora_layers

    print(f"full sizes on the meta device; bytes per rank under FSDP2 over {world} ranks (fp32)")
    print(f"{'model':<12} {'run':<6} {'trainable':>14} {'adapted':>8} {'AdamW state':>12} {'gradients':>11}")
    for name in ("pi05", "groot"):
        rows = {}
        for run, cfg in zip(("full", "lora"), _configs(name, "full"), strict=True):
            with torch.device("meta"):
                model = build_model(cfg)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            rows[run] = trainable
            print(f"{name + ' full':<12} {run:<6} {trainable:>14,} {len(lora_layers(model)):>8} "
                  f"{2 * 4 * trainable / world / GIB:>8.3f} GiB {4 * trainable / world / GIB:>7.3f} GiB")
        print(f"{'':<12} full/lora: {rows['full'] / rows['lora']:,.0f}x fewer trainable parameters and optimizer state "
              f"with LoRA; base weights {total * 4 / world / GIB:.2f} GiB per rank either way")


def step_time(steps: int, warmup: int, micro_batch: int) -> None:
    from embodyhpc.models import build_model
    from embodyhpc.train.optim import build_optimizer

    torch.set_num_threads(1)
    runs = {}
    for run, cfg in zip(("full", "lora"), _configs("pi05", "tiny"), strict=True):
        torch.manual_seed(0)
        model = build_model(cfg).train()
        runs[run] = (model, build_optimizer(model, lr=1e-4, weight_decay=0.01))
    batches = pi05_batches(_configs("pi05", "tiny")[0], 8, micro_batch)
    done = 0

    def step(run: str) -> float:
        nonlocal done
        model, optimizer = runs[run]
        started = time.perf_counter()
        model(batches[done % len(batches)]).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done += 1
        return time.perf_counter() - started

    for _ in range(warmup):
        step("full"), step("lora")
    times: dict[str, list[float]] = {"full": [], "lora": []}
    for _ in range(steps):  # interleaved
        for run in ("full", "lora"):
            times[run].append(step(run))
    print(f"\nstep time, tiny pi0.5 on the CPU (micro-batch {micro_batch}, 1 thread, medians of {steps}; "
          f"load average {os.getloadavg()[0]:.1f})")
    for run in ("full", "lora"):
        model, optimizer = runs[run]
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor) and t.ndim > 0)
        print(f"  {run:<5} {statistics.median(times[run]) * 1e3:8.1f} ms   trainable {trainable:>9,}   "
              f"AdamW state {state / 1e6:7.3f} MB")
    ratio = statistics.median(times["lora"]) / statistics.median(times["full"])
    print(f"  lora / full step time: {ratio:.3f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, help="ranks the full-size state is sharded over")
    parser.add_argument("--steps", type=int, default=20, help="timed step pairs (full and LoRA)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    counts(args.world)
    step_time(args.steps, args.warmup, args.micro_batch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
