"""Useful VLM tokens/s of a GR00T training step (forward + backward + AdamW), packed rows vs one sample per row.

    python bench/groot_packing.py                       # "bench" shape (bench/groot_common.py), 32 samples, ~2 min
    python bench/groot_packing.py --size tiny --samples 64 --budget 512 --threads 2

A micro-batch of skewed instruction lengths (bench/groot_common.skewed_batch: 2 cameras, 5-300 text tokens) runs
two ways over the same samples, noise and times:
- padded (the baseline): one sample per row, every row padded to the batch's longest VLM sequence, which is what
  the LLM, the VL adapter and the DiT's cross-attention then compute (the published GR00T pads the same way);
- packed: first-fit-decreasing rows of --budget VLM tokens (embodyhpc.data.packing), passed as `rows`.
The VLM is frozen, as in GR00T's fine-tuning (its forward still runs every step). Both must give the same loss.
Printed: useful tokens (image patches + instruction tokens), tokens each variant computes in the VLM rows, median
step ms, and speedup = padded / packed time (> 1: packing is faster). No goal; it always exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from groot_common import build, skewed_batch  # noqa: E402

from embodyhpc.data.packing import first_fit_decreasing  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bench", choices=("bench", "tiny"))
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--budget", type=int, default=768, help="VLM tokens per packed row")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build(args.size)
    batch = skewed_batch(model, args.samples, args.seed)
    counts = batch.token_counts(model.shape.vision.num_patches)
    rows = first_fit_decreasing(counts, args.budget)
    variants = {"padded": batch, "packed": batch.with_rows(rows)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    noise = torch.randn(batch.actions.shape, generator=torch.Generator().manual_seed(1))
    times_in = torch.rand(args.samples, generator=torch.Generator().manual_seed(2))

    def step(b) -> float:
        loss = model(b, noise=noise, time=times_in).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    with torch.no_grad():
        losses = {name: float(model(b, noise=noise, time=times_in).loss) for name, b in variants.items()}
    for b in variants.values():
        step(b)  # warm-up
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):  # interleaved: drift on shared cores hits both alike
        for name, b in variants.items():
            start = time.perf_counter()
            step(b)
            timings[name].append(time.perf_counter() - start)
    useful = sum(counts)
    longest_row = max(sum(counts[i] for i in row) for row in rows)
    computed = {"padded": args.samples * max(counts), "packed": len(rows) * longest_row}
    ms = {name: statistics.median(t) * 1e3 for name, t in timings.items()}
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"# GR00T training step, size {args.size} ({params:.1f} M parameters), CPU, torch {torch.__version__}, "
          f"{args.threads} thread(s), {args.samples} samples, budget {args.budget}, median of {args.reps}")
    print(f"{'variant':>8} {'rows':>5} {'VLM tokens':>11} {'useful':>7} {'step ms':>9} {'useful tok/s':>13}")
    for name in variants:
        num_rows = args.samples if name == "padded" else len(rows)
        print(f"{name:>8} {num_rows:>5} {computed[name]:>11} {useful:>7} {ms[name]:>9.1f} "
              f"{useful / ms[name] * 1e3:>13.0f}")
    agree = abs(losses["padded"] - losses["packed"]) <= 1e-4 * max(1.0, abs(losses["padded"]))
    print(f"speedup packed vs padded: {ms['padded'] / ms['packed']:.2f}x (ideal token ratio "
          f"{computed['padded'] / computed['packed']:.2f}x); losses {'agree' if agree else 'DIFFER (bug?)'} "
          f"({losses['padded']:.6f} vs {losses['packed']:.6f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
