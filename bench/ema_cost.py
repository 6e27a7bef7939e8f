"""What train.ema_decay costs: memory per rank and step time, against the same training without the average.

    python bench/ema_cost.py                     # ~30 s: full sizes on the meta device, the tiny pi0.5 on the CPU
    python bench/ema_cost.py --world 8 --steps 20 --micro-batch 4

Memory, at the full sizes (pi0.5 full, GR00T full), on the meta device (no memory, no weights): the model as training
builds it, embodyhpc.train.ema.ParameterEMA over it, and what each rank holds under FSDP2 on --world ranks (every
tensor sharded over the ranks, as the tests hold for the average: DTensor shards of the parameters' local size):
fp32 parameters, fp32 gradients, AdamW's two fp32 moments, and the average (ParameterEMA.local_bytes / world).
Printed: GiB per rank of each, and the average against the training state without it (parameters + gradients +
optimizer state): the ratio of the run with the average to the run without. Activations are left out (they depend
on the batch), so the ratio is an upper bound of the share of device memory.

Step time, at the tiny size on the CPU (one process, one thread: the average's update is the same per-shard work on
every rank, no collective): a training step (forward, backward, AdamW, zero_grad, the loop's order) with and without
`ema.update()` after the optimizer step, interleaved step by step so drift hits both alike, medians over --steps
pairs; and the update alone, with the bytes it reads and writes per second, on the tiny model and on one flat fp32
parameter of --update-params elements (out of the caches: the memory-bound rate a rank's shard of a full-size model
sees). Printed: the ratio of the two step times, and the update's time per step for each full size's shard per rank
at that rate. There is no goal: for the record (the update reads the parameters and the average and writes the
average once per step, 12 bytes per parameter, against AdamW's ~28). Always exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pi05_common import ACTION_DIM, HORIZON, pi05_batches  # noqa: E402

DECAY = 0.99
GIB = 1024**3


def memory(world: int) -> dict[str, int]:
    from embodyhpc.config.schema import ModelConfig
    from embodyhpc.models import build_model
    from embodyhpc.train.ema import ParameterEMA

    print(f"memory per rank, FSDP2 over {world} ranks (fp32 parameters, gradients, AdamW moments; activations aside)")
    print(f"{'model':<12} {'trainable':>12} {'train state':>12} {'EMA':>9} {'with/without':>13}")
    shards = {}
    for name in ("pi05", "groot"):
        with torch.device("meta"):
            model = build_model(ModelConfig(name=name, size="full"))
        ema = ParameterEMA(model, DECAY)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        params = sum(p.numel() * 4 for p in model.parameters())  # fp32 master weights, frozen ones included
        state = (params + trainable * 4 * 3) / world  # + gradients + exp_avg + exp_avg_sq of the trainable ones
        average = ema.local_bytes() / world
        print(f"{name + ' full':<12} {trainable / 1e9:>10.2f} B {state / GIB:>8.2f} GiB {average / GIB:>5.2f} GiB "
              f"{(state + average) / state:>12.3f}x")
        shards[f"{name} full"] = ema.num_parameters // world
    return shards


def step_time(steps: int, warmup: int, micro_batch: int) -> None:
    from embodyhpc.config.schema import ModelConfig
    from embodyhpc.models import build_model
    from embodyhpc.train.ema import ParameterEMA
    from embodyhpc.train.optim import build_optimizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = ModelConfig(size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM, max_token_len=160)
    model = build_model(cfg)
    model.train()
    optimizer = build_optimizer(model, lr=1e-4, weight_decay=0.01)
    ema = ParameterEMA(model, DECAY)
    batches = pi05_batches(cfg, 8, micro_batch)
    done = 0

    def step(with_ema: bool) -> float:
        nonlocal done
        started = time.perf_counter()
        model(batches[done % len(batches)]).loss.backward()
        optimizer.step()
        if with_ema:
            ema.update()
        optimizer.zero_grad(set_to_none=True)
        done += 1
        return time.perf_counter() - started

    for _ in range(warmup):
        step(True)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(steps):  # interleaved
        for with_ema in (False, True):
            times[with_ema].append(step(with_ema))
    updates = []
    for _ in range(max(steps, 20)):
        started = time.perf_counter()
        ema.update()
        updates.append(time.perf_counter() - started)
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    update = statistics.median(updates)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"\nstep time, tiny pi0.5 on the CPU ({params / 1e6:.1f} M trainable parameters, micro-batch {micro_batch}, "
          f"1 thread, medians of {steps})")
    print(f"  without EMA {without * 1e3:8.1f} ms")
    print(f"  with EMA    {with_ * 1e3:8.1f} ms   ratio {with_ / without:.3f}x")
    print(f"  update alone {update * 1e3:7.2f} ms   ({12 * params / update / 1e9:.1f} GB/s read+written)")
    opt_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                    if isinstance(t, torch.Tensor))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"  bytes: parameters {param_bytes / 1e6:.1f} MB, AdamW state {opt_bytes / 1e6:.1f} MB, "
          f"EMA {ema.local_bytes() / 1e6:.1f} MB")


def update_rate(numel: int, shards: dict[str, int]) -> None:
    """The update alone on one flat fp32 parameter of `numel` elements: bytes read and written per second, and what
    that rate makes of each full size's shard per rank."""
    from torch import nn

    from embodyhpc.train.ema import ParameterEMA

    holder = nn.Module()
    holder.weight = nn.Parameter(torch.randn(numel))
    ema = ParameterEMA(holder, DECAY)
    ema.update()  # first touch of every page
    times = []
    for _ in range(7):
        started = time.perf_counter()
        ema.update()
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    rate = 12 * numel / seconds
    print(f"\nupdate alone, one fp32 parameter of {numel / 1e6:.0f} M elements: {seconds * 1e3:.1f} ms, "
          f"{rate / 1e9:.1f} GB/s read+written")
    for name, per_rank in shards.items():
        print(f"  {name}: {per_rank / 1e6:.0f} M parameters per rank -> {12 * per_rank / rate * 1e3:.0f} ms per "
              "step at this rate")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=8, help="ranks the full-size state is sharded over")
    parser.add_argument("--steps", type=int, default=40, help="timed step pairs (with and without the average)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--update-params", type=float, default=25e6, help="elements of the flat parameter")
    args = parser.parse_args()
    shards = memory(args.world)
    step_time(args.steps, args.warmup, args.micro_batch)
    update_rate(int(args.update_params), shards)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
