"""torch.compile of pi0.5's blocks on packed batches: graph breaks, recompiles and graphs per compiled block.

    python bench/compile_blocks.py                        # 50 packed batches, aot_eager, AC off and full (~2 min)
    python bench/compile_blocks.py --backend eager --batches 20 --ac full

The tiny pi0.5 is built on the meta device and wrapped by embodyhpc.parallel.parallelize on a 1-rank gloo group,
exactly as training wraps it (activation checkpointing, per-block compile, FSDP2), every compiled block given
the one counting backend (embodyhpc.parallel.compile_stats, as training gives them one) around eager or aot_eager
(no inductor: CPU C++ builds would dominate). Each batch is a different mix, deterministic from --seed: 3-6
samples, 1-3 cameras (absent cameras contribute no tokens), instructions of 1-40 words, packed first-fit-decreasing
into rows of model.max_token_len tokens as the data pipeline packs them; forward, backward and an AdamW step.

Goal (issue 14): 0 graph breaks per compiled block and at most 3 recompiles over 50 batches, with AC off and on.
Prints one row per block and mode, the goal verdict (ok / OVER), and the mean step time against the same model
run eagerly in this process (for the record; the eager/aot_eager backends do not fuse, so no speedup is expected).
Exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORDS = ("pick", "up", "the", "red", "block", "and", "place", "it", "in", "blue", "bowl", "open", "top", "drawer",
         "slowly", "then", "close", "left", "door", "of", "cabinet", "push", "green", "cup", "towards", "robot")
MAX_BREAKS, MAX_RECOMPILES = 0, 3


def batches(cfg, count: int, seed: int) -> list:
    from embodyhpc.data.packing import first_fit_decreasing
    from embodyhpc.models import build_tokenizer
    from embodyhpc.models.pi05 import Pi05Sample, collate, max_prompt_tokens, shape_for

    tokenizer, shape = build_tokenizer(cfg), shape_for(cfg.size)
    g = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    out = []
    for _ in range(count):
        samples = []
        for _ in range(randint(3, 6)):
            present = torch.tensor([True] + [bool(randint(0, 1)) for _ in range(2)])
            words = " ".join(WORDS[randint(0, len(WORDS) - 1)] for _ in range(randint(1, 40)))
            samples.append(Pi05Sample(images=torch.rand(3, 3, 32, 32, generator=g), instruction=words,
                                      state=torch.rand(4, generator=g) * 2 - 1, image_mask=present,
                                      actions=torch.randn(cfg.action_horizon, cfg.action_dim, generator=g)))
        batch = collate(samples, tokenizer, max_prompt_tokens=max_prompt_tokens(cfg, 3))
        rows = first_fit_decreasing(batch.token_counts(shape.vision.num_patches, cfg.action_horizon),
                                    cfg.max_token_len)
        out.append(batch.with_rows(rows))
    return out


def run(mode: str, ac: str, backend: str, data: list, cfg) -> tuple[dict, int, float]:
    """(per-block stats, graph breaks counted process-wide, mean step seconds after the first 3 batches)."""
    import torch._dynamo

    from embodyhpc.config.schema import ParallelismConfig, PrecisionConfig
    from embodyhpc.models import build_model
    from embodyhpc.parallel import build_mesh, materialize, parallelize
    from embodyhpc.parallel.compile_stats import CompileStats

    torch._dynamo.reset()
    stats = CompileStats(backend)
    with torch.device("meta"):
        model = build_model(cfg, PrecisionConfig(mode="fp32"))
    parallelize(model, ParallelismConfig(activation_checkpointing=ac, compile=mode == "compiled"),
                PrecisionConfig(mode="fp32"), build_mesh(1, 1, "cpu"), compile_backend=stats.backend_for)
    stats.attach(model)
    materialize(model, "cpu", seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for batch in data:
        started = time.perf_counter()
        model(batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return stats.report(), stats.graph_breaks_total, statistics.mean(times[3:] or times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--backend", choices=("eager", "aot_eager"), default="aot_eager")
    parser.add_argument("--ac", choices=("none", "full", "both"), default="both")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import torch.distributed as dist

    from embodyhpc.config.schema import ModelConfig

    cfg = ModelConfig(size="tiny", action_horizon=8, action_dim=8, max_token_len=256)
    data = batches(cfg, args.batches, args.seed)
    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
        try:
            print(f"{args.batches} packed batches of the tiny pi0.5, compile backend {args.backend}, "
                  f"{sum(len(b.packing_rows()) for b in data)} rows in all")
            print(f"{'AC':<5} {'block':<18} {'graphs':>6} {'breaks':>6} {'recompiles':>10}  goal")
            for ac in (("none", "full") if args.ac == "both" else (args.ac,)):
                report, breaks_total, compiled_s = run("compiled", ac, args.backend, data, cfg)
                _, _, eager_s = run("eager", ac, args.backend, data, cfg)
                for block, row in report.items():
                    ok = row["breaks"] <= MAX_BREAKS and row["recompiles"] <= MAX_RECOMPILES
                    print(f"{ac:<5} {block:<18} {row['graphs']:>6} {row['breaks']:>6} {row['recompiles']:>10}  "
                          f"{'ok' if ok else 'OVER'}")
                print(f"{ac:<5} graph breaks counted by dynamo (all blocks): {breaks_total}; step {compiled_s:.3f} s "
                      f"compiled vs {eager_s:.3f} s eager ({compiled_s / eager_s:.2f}x)")
            print(f"goal: <= {MAX_BREAKS} graph breaks and <= {MAX_RECOMPILES} recompiles per block")
        finally:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
