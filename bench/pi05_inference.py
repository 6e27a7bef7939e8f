"""pi0.5 inference latency on CPU: `Pi05Policy.sample_actions` with the prefix KV cache vs recomputing the prefix.

    python bench/pi05_inference.py                    # tiny + small-2L, batch 1 and 8, 10 Euler steps, ~1.5 min
    python bench/pi05_inference.py --only tiny --reps 9 --batches 1 8 32
    python bench/pi05_inference.py --steps 5 --threads 2

Models: `tiny` (the test-suite pi0.5, built with build_model(ModelConfig(size="tiny")): 32 px images, 16 patches
per camera, 8-step action chunk) and `small-2L` (the small size's widths and heads: VLM 768, expert 384,
12 query heads x 64, 224 px images with 196 patches per camera, a 50-step action chunk; cut to 2 joint layers and
1 vision block so that one call takes about a second on one core). Batches: 2 cameras, short instructions and a
6-d state in the prompt, collated with `embodyhpc.models.pi05.batching` (one sample per row) as the model tests do.

Measured: wall time of one `sample_actions(batch, num_steps=--steps, noise=...)` call, with `use_kv_cache=True`
(vision tower and prefix run once; each Euler step runs only the action expert against the cached keys/values)
and `use_kv_cache=False` (the full model, prefix included, at every step: the baseline). Every time is the median
of --reps runs (--small-reps for small-2L, whose uncached batch of 8 takes ~14 s) after one warm-up, the two
variants interleaved so that drift on the shared cores hits both alike. Printed: the prefix tokens of the whole
batch (the flat prefix stream, aligned to 16), the median ms of each variant, and speedup = no-cache / cache
(> 1: the cache is faster; about --steps at most, when the prefix dominates the cost). The actions of both
variants must agree (same noise; a cache bug would show there). No goal: it reports, and always exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

NUM_CAMERAS, STATE_DIM, ACTION_DIM = 2, 6, 8
INSTRUCTIONS = ("pick up the cup", "open the top drawer", "push the red block to the left edge", "close it")


def build(name: str):
    """(model, image size, horizon) for a model name; the model in eval mode, seeded."""
    from embodyhpc.config.schema import ModelConfig
    from embodyhpc.models import build_model
    from embodyhpc.models.pi05 import Pi05Policy
    from embodyhpc.models.pi05.shapes import SHAPES, Pi05Shape
    from embodyhpc.models.shapes import VisionShape

    torch.manual_seed(0)
    if name == "tiny":
        cfg = ModelConfig(size="tiny", action_horizon=8, action_dim=ACTION_DIM, max_token_len=160)
        return build_model(cfg).eval(), SHAPES["tiny"].vision.image_size, cfg.action_horizon
    small = SHAPES["small"]
    vision = small.vision
    shape = Pi05Shape(vision=VisionShape(image_size=vision.image_size, patch_size=vision.patch_size,
                                         width=vision.width, depth=1, num_heads=vision.num_heads,
                                         mlp_dim=vision.mlp_dim),
                      vlm=small.vlm, expert=small.expert, depth=2, num_heads=small.num_heads,
                      num_kv_heads=small.num_kv_heads, head_dim=small.head_dim, vocab_size=small.vocab_size)
    # not a ModelConfig size (build_model knows tiny/small/full only): the same constructor build_pi05 calls
    return Pi05Policy(shape, action_horizon=50, action_dim=ACTION_DIM).eval(), vision.image_size, 50


def make_batch(num_samples: int, image_size: int, seed: int):
    from embodyhpc.config.schema import ModelConfig
    from embodyhpc.models import build_tokenizer
    from embodyhpc.models.pi05 import Pi05Sample, collate

    g = torch.Generator().manual_seed(seed)
    samples = [Pi05Sample(images=torch.rand(NUM_CAMERAS, 3, image_size, image_size, generator=g),
                          instruction=INSTRUCTIONS[i % len(INSTRUCTIONS)],
                          state=torch.rand(STATE_DIM, generator=g) * 2 - 1, actions=None)
               for i in range(num_samples)]
    return collate(samples, build_tokenizer(ModelConfig(size="tiny")), max_prompt_tokens=64)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_one(name: str, args: argparse.Namespace) -> None:
    model, image_size, horizon = build(name)
    params = sum(p.numel() for p in model.parameters())
    print(f"\n## {name}: {params / 1e6:.1f} M parameters, {NUM_CAMERAS} cameras x "
          f"{model.shape.vision.num_patches} patches, action chunk {horizon}, {args.steps} Euler steps")
    print(f"{'batch':>5} {'prefix tok':>10} {'cache ms':>9} {'no-cache ms':>12} {'speedup':>8}  actions")
    for batch_size in args.batches:
        batch = make_batch(batch_size, image_size, args.seed)
        plan = model.token_plan(batch)
        noise = torch.randn(batch_size, horizon, ACTION_DIM, generator=torch.Generator().manual_seed(args.seed + 1))

        def run(use_kv_cache: bool, batch=batch, noise=noise) -> torch.Tensor:
            return model.sample_actions(batch, num_steps=args.steps, noise=noise, use_kv_cache=use_kv_cache)

        outputs = {cache: run(cache) for cache in (True, False)}  # also the warm-up
        times: dict[bool, list[float]] = {True: [], False: []}
        reps = args.reps if name == "tiny" else args.small_reps
        for _ in range(reps):  # interleaved: drift on shared cores hits both variants alike
            for cache in (True, False):
                times[cache].append(timed(lambda cache=cache: run(cache)))
        cached, uncached = statistics.median(times[True]), statistics.median(times[False])
        diff = float((outputs[True] - outputs[False]).abs().max())
        verdict = "agree" if diff <= 1e-4 else "DIFFER (bug?)"
        print(f"{batch_size:>5} {plan.prefix_source.shape[1]:>10} {cached * 1e3:>9.1f} {uncached * 1e3:>12.1f} "
              f"{uncached / cached:>7.2f}x  {verdict} (max |diff| {diff:.1e})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("tiny", "small-2L"), help="run one model only")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--steps", type=int, default=10, help="Euler steps per sample_actions call")
    parser.add_argument("--reps", type=int, default=5, help="timed calls per variant (median reported)")
    parser.add_argument("--small-reps", type=int, default=3, help="timed calls per variant for small-2L")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (2 shared cores here)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# pi0.5 sample_actions latency, CPU, torch {torch.__version__}, {args.threads} thread(s), median of "
          f"{args.reps} (small-2L: {args.small_reps}); speedup = no-cache time / KV-cache time "
          "(> 1: the cache is faster)")
    for name in [args.only] if args.only else ["tiny", "small-2L"]:
        try:
            bench_one(name, args)
        except Exception as exc:  # a bench reports; it never fails the caller
            print(f"## {name}: failed: {type(exc).__name__}: {exc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
