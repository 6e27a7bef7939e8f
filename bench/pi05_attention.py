"""pi0.5 attention backends on CPU: forward + backward time of a training step, packed vs padded, as ratios.

    python bench/pi05_attention.py                  # tiny + small-shaped, ~1-2 min on 2 shared cores
    python bench/pi05_attention.py --flex           # + flex forward-only rows (slow: eager on CPU)
    python bench/pi05_attention.py --only tiny --reps 5 --threads 2

Models: `tiny` (the tiny pi0.5 as shipped) and `small-2L` (the small size's widths and heads: VLM 768, expert 384,
12 query heads x 64, 224 px images with 196 patches per camera, a 50-step action chunk; cut to 2 joint layers and
1 vision block so one step takes about a second: the first layer runs the joint attention, the last the
keys/values-only prefix with the action queries, as in every depth of the real model).
Micro-batch: a skewed length mix, deterministic from --seed: 1-3 cameras (60/30/10 %, absent cameras contribute
no tokens) and instructions of 2-6 words (70 %), 10-25 (25 %) or 40-70 (5 %).
Padded: one sample per row (what `collate` without rows gives). Packed: first-fit-decreasing rows of --budget
tokens (embodyhpc.data.packing), as the data pipeline packs them.

Backends: the ones that train on CPU (embodyhpc.models.attention.CPU_TRAINING_BACKENDS: sdpa_reference with the
dense prefix-LM mask, sdpa_segments with the per-segment varlen plan). flex runs on CPU for inference only (no
backward in torch 2.13), so `--flex` adds forward-only rows compared with the padded reference's forward.
Every time is the median of --reps interleaved runs after one warm-up, printed with its ratio to the padded
sdpa_reference step measured in the same process (ratio < 1: faster). Losses of all variants are checked to agree
(a layout or backend bug would show there). Always exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

WORDS = ("pick", "up", "the", "red", "block", "and", "place", "it", "in", "blue", "bowl", "open", "top", "drawer",
         "slowly", "then", "close", "left", "door", "of", "cabinet", "push", "green", "cup", "towards", "robot")
NUM_CAMERAS, STATE_DIM, ACTION_DIM = 3, 6, 8


def shapes() -> dict[str, tuple]:
    """name -> (shape, image size, action horizon, samples, packing budget)."""
    from embodyhpc.models.pi05.shapes import SHAPES, Pi05Shape
    from embodyhpc.models.shapes import VisionShape

    small = SHAPES["small"]
    vision = small.vision
    small_2l = Pi05Shape(vision=VisionShape(image_size=vision.image_size, patch_size=vision.patch_size,
                                            width=vision.width, depth=1, num_heads=vision.num_heads,
                                            mlp_dim=vision.mlp_dim),
                         vlm=small.vlm, expert=small.expert, depth=2, num_heads=small.num_heads,
                         num_kv_heads=small.num_kv_heads, head_dim=small.head_dim, vocab_size=small.vocab_size)
    return {"tiny": (SHAPES["tiny"], 32, 8, 24, 256), "small-2L": (small_2l, 224, 50, 6, 1024)}


def make_samples(num_samples: int, image_size: int, horizon: int, seed: int) -> list:
    from embodyhpc.models.pi05 import Pi05Sample

    g = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:  # inclusive
        return int(torch.randint(low, high + 1, (1,), generator=g))

    samples = []
    for _ in range(num_samples):
        u = float(torch.rand(1, generator=g))
        cameras = 1 if u < 0.6 else 2 if u < 0.9 else 3
        u = float(torch.rand(1, generator=g))
        words = randint(2, 6) if u < 0.70 else randint(10, 25) if u < 0.95 else randint(40, 70)
        samples.append(Pi05Sample(
            images=torch.rand(NUM_CAMERAS, 3, image_size, image_size, generator=g),
            instruction=" ".join(WORDS[randint(0, len(WORDS) - 1)] for _ in range(words)),
            state=torch.rand(STATE_DIM, generator=g) * 2 - 1, actions=torch.randn(horizon, ACTION_DIM, generator=g),
            image_mask=torch.arange(NUM_CAMERAS) < cameras))
    return samples


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_one(name: str, args: argparse.Namespace) -> None:
    from embodyhpc.data.packing import first_fit_decreasing, packing_stats
    from embodyhpc.models.attention import CPU_TRAINING_BACKENDS
    from embodyhpc.models.pi05 import Pi05Policy, collate
    from embodyhpc.models.tokenizer import load_tokenizer

    shape, image_size, horizon, num_samples, budget = shapes()[name]
    torch.manual_seed(args.seed)
    model = Pi05Policy(shape, action_horizon=horizon, action_dim=ACTION_DIM)
    samples = make_samples(num_samples, image_size, horizon, args.seed)
    padded = collate(samples, load_tokenizer("tiny", None), max_prompt_tokens=96)
    lengths = padded.token_counts(shape.vision.num_patches, horizon)
    rows = first_fit_decreasing(lengths, budget)
    batches = {"padded": padded, "packed": padded.with_rows(rows)}
    g = torch.Generator().manual_seed(args.seed + 1)
    noise, flow_time = torch.randn(num_samples, horizon, ACTION_DIM, generator=g), torch.rand(num_samples, generator=g)

    variants = [(mode, backend, True) for backend in CPU_TRAINING_BACKENDS for mode in batches]
    if args.flex:
        variants += [("padded", "sdpa_reference", False), *((mode, "flex", False) for mode in batches)]

    def run(mode: str, backend: str, backward: bool) -> float:
        model.attention_backend = backend
        model.zero_grad(set_to_none=True)
        if backward:
            out = model(batches[mode], noise=noise, time=flow_time)
            out.loss.backward()
        else:
            with torch.no_grad():
                out = model(batches[mode], noise=noise, time=flow_time)
        return out.loss.item()

    losses = {v: run(*v) for v in variants}  # also the warm-up (flex builds its block masks here)
    times: dict[tuple, list[float]] = {v: [] for v in variants}
    for _ in range(args.reps):  # interleaved: drift on shared cores hits every variant alike
        for v in variants:
            times[v].append(timed(lambda v=v: run(*v)))
    median = {v: statistics.median(t) for v, t in times.items()}

    stats = packing_stats(lengths, rows, budget)
    params = sum(p.numel() for p in model.parameters())
    print(f"\n## {name}: {params / 1e6:.1f} M parameters, {num_samples} samples, {sum(lengths)} useful tokens "
          f"(lengths {min(lengths)}-{max(lengths)}); padded: {num_samples} rows x {max(lengths)}; packed: "
          f"{len(rows)} rows of <= {budget} (packer efficiency {stats.packing_efficiency:.1%})")
    print(f"{'mode':<7} {'backend':<15} {'pass':<9} {'median s':>9} {'vs padded ref':>14}  loss")
    for kind, reference in ((True, ("padded", "sdpa_reference", True)),
                            (False, ("padded", "sdpa_reference", False))):
        for v in variants:
            if v[2] != kind:
                continue
            mode, backend, backward = v
            ratio = median[v] / median[reference]
            print(f"{mode:<7} {backend:<15} {'fwd+bwd' if backward else 'fwd only':<9} {median[v]:>9.3f} "
                  f"{ratio:>13.2f}x  {losses[v]:.6f}")
    spread = max(losses.values()) - min(losses.values())
    verdict = "agree" if spread <= 1e-4 * max(1.0, abs(losses[variants[0]])) else "DIFFER (bug?)"
    print(f"losses of all variants {verdict} (max - min = {spread:.2e})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=tuple(shapes()), help="run one model only")
    parser.add_argument("--reps", type=int, default=2, help="timed runs per variant (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (2 shared cores here)")
    parser.add_argument("--flex", action="store_true", help="add forward-only rows for flex (CPU inference only)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# pi0.5 attention backends, CPU, torch {torch.__version__}, {args.threads} thread(s), "
          f"median of {args.reps}; ratio = time / time of the padded sdpa_reference step (< 1: faster)")
    for name in [args.only] if args.only else list(shapes()):
        try:
            bench_one(name, args)
        except Exception as exc:  # a bench reports; it never fails the caller
            print(f"## {name}: failed: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
