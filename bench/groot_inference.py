"""GR00T sampling latency on CPU: `GrootPolicy.sample_actions` with 4 Euler steps (GR00T-N1.5's), VLM features
computed once per chunk, against recomputing the VLM at every step.

    python bench/groot_inference.py                     # "bench" shape and tiny, batch 1 and 8, ~1 min
    python bench/groot_inference.py --only tiny --batches 1 8 32 --steps 4 --reps 9

Measured: the median wall time of one call over --reps after a warm-up, the two variants interleaved. The baseline
runs `model.encode` (vision tower, LLM, VL adapter) before every DiT pass, as a sampler that treats the network
as one function would; ours (sample_actions) encodes once and runs only the action head per step. Both use the
same noise and must agree. Printed: ms of each, speedup = baseline / ours (> 1: ours is faster; at most about the
number of steps when the VLM dominates). No goal; it always exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from groot_common import ACTION_DIM, HORIZON, build, skewed_batch  # noqa: E402


@torch.no_grad()
def sample_recomputing(model, batch, noise: torch.Tensor, num_steps: int) -> torch.Tensor:
    """The baseline: the same Euler steps, the VLM encoded again before each."""
    x, plan, state = noise.float(), model.plan(batch), model.padded_state(batch)
    for step in range(num_steps):
        context, ctx = model.encode(batch, plan)
        time_now = torch.full((batch.num_samples,), step / num_steps)
        x = x + model.action_head.velocity(context, state, x, model.timestep_bucket(time_now), batch.embodiment,
                                           ctx) / num_steps
    return x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("bench", "tiny"))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# GR00T sample_actions latency, CPU, torch {torch.__version__}, {args.threads} thread(s), {args.steps} "
          f"Euler steps, median of {args.reps}; speedup = VLM-every-step / VLM-once")
    for size in [args.only] if args.only else ["bench", "tiny"]:
        model = build(size).eval()
        print(f"\n## {size}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters")
        print(f"{'batch':>5} {'once ms':>9} {'every-step ms':>14} {'speedup':>8}  actions")
        for batch_size in args.batches:
            batch = skewed_batch(model, batch_size, seed=batch_size, with_actions=False)
            noise = torch.randn(batch_size, HORIZON, ACTION_DIM, generator=torch.Generator().manual_seed(3))
            runs = {"once": lambda b=batch, n=noise, m=model: m.sample_actions(b, num_steps=args.steps, noise=n),
                    "every": lambda b=batch, n=noise, m=model: sample_recomputing(m, b, n, args.steps)}
            outputs = {name: run() for name, run in runs.items()}
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(args.reps):
                for name, run in runs.items():
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
            once, every = (statistics.median(times[k]) * 1e3 for k in ("once", "every"))
            diff = float((outputs["once"] - outputs["every"]).abs().max())
            print(f"{batch_size:>5} {once:>9.1f} {every:>14.1f} {every / once:>7.2f}x  "
                  f"{'agree' if diff <= 1e-4 else 'DIFFER (bug?)'} (max |diff| {diff:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
