"""Training steps/s of the tiny pi0.5 on 2 CPU ranks (gloo): FSDP2 as embodyhpc.parallel applies it vs torch DDP.

    python bench/fsdp_vs_ddp.py                         # 2 ranks, 6 blocks x 5 steps per wrapper, ~20 s
    python bench/fsdp_vs_ddp.py --blocks 6 --steps 10 --micro-batch 8

Two processes (torch.multiprocessing spawn, a file:// rendezvous in a fresh temp folder: no port to race for, as
tests/parallel/harness.py does), one thread each, gloo. Both wrappers live in the same two processes:
- FSDP2: the training loop's order (embodyhpc/train/loop.py): build_mesh(1, 2, "cpu"), build_model on the meta
  device, parallelize (FSDP2 on every declared unit, then the root; precision fp32, no AC, no compile),
  torch.manual_seed(0), materialize on the CPU;
- DDP: build_model on the CPU, torch.manual_seed(0), init_weights() (the same draws materialize makes, so both
  start from the same weights), then DistributedDataParallel (gloo all-reduce of gradient buckets).
Each rank gets its own micro-batch (--micro-batch samples, 2 cameras, short instructions), the same for both
wrappers at the same step, and the same flow-matching noise and times. A step: forward, backward, AdamW
(embodyhpc.train.optim.build_optimizer), zero_grad.

Timing: after --warmup steps of each, --blocks blocks of --steps steps of one wrapper then the other (interleaved,
so drift on the shared cores hits both alike), each block between two barriers; steps/s = --steps / median block
time on rank 0. Printed: steps/s of each (and samples/s over both ranks), ratio FSDP2 / DDP. The losses of the two
wrappers are compared at every step (same weights, batches and noise: they must agree). There is no goal: the
tiny model is far too small for sharding to pay, so this is for the record (per-unit all-gather and
reduce-scatter against one all-reduce per bucket). Always exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp

WORLD_SIZE, NUM_CAMERAS, ACTION_DIM, HORIZON = 2, 2, 8, 8
INSTRUCTIONS = ("pick up the cup", "open the top drawer", "push the red block to the left edge", "close it")


def model_cfg():
    from embodyhpc.config.schema import ModelConfig

    return ModelConfig(size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM, max_token_len=160)


def make_batches(rank: int, count: int, micro_batch: int) -> list:
    """`count` micro-batches of this rank, each with its (noise, time) for the flow-matching loss."""
    from embodyhpc.models import build_tokenizer
    from embodyhpc.models.pi05 import Pi05Sample, collate, max_prompt_tokens

    cfg = model_cfg()
    tokenizer, max_prompt = build_tokenizer(cfg), max_prompt_tokens(cfg, NUM_CAMERAS)
    g = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(count):
        samples = [Pi05Sample(images=torch.rand(NUM_CAMERAS, 3, 32, 32, generator=g),
                              instruction=INSTRUCTIONS[int(torch.randint(len(INSTRUCTIONS), (1,), generator=g))],
                              state=torch.rand(6, generator=g) * 2 - 1,
                              actions=torch.randn(HORIZON, ACTION_DIM, generator=g)) for _ in range(micro_batch)]
        noise = torch.randn(micro_batch, HORIZON, ACTION_DIM, generator=g)
        batches.append((collate(samples, tokenizer, max_prompt_tokens=max_prompt), noise,
                        torch.rand(micro_batch, generator=g) * 0.999 + 0.001))
    return batches


def build_fsdp():
    from embodyhpc.config.schema import ParallelismConfig, PrecisionConfig
    from embodyhpc.models import build_model
    from embodyhpc.parallel import build_mesh, materialize, parallelize

    mesh = build_mesh(1, WORLD_SIZE, "cpu")
    precision = PrecisionConfig(mode="fp32")
    with torch.device("meta"):
        model = build_model(model_cfg(), precision)
    parallelize(model, ParallelismConfig(), precision, mesh)
    torch.manual_seed(0)
    materialize(model, "cpu")
    return model.train()


def build_ddp():
    from torch.nn.parallel import DistributedDataParallel

    from embodyhpc.models import build_model

    model = build_model(model_cfg())
    torch.manual_seed(0)
    model.init_weights()  # the draws materialize makes for the FSDP2 model: the same initial weights
    return DistributedDataParallel(model.train())


def rank_main(rank: int, folder: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from embodyhpc.train.optim import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=WORLD_SIZE,
                            timeout=timedelta(seconds=300))
    try:
        batches = make_batches(rank, args.warmup + args.blocks * args.steps, args.micro_batch)
        models = {"FSDP2": build_fsdp(), "DDP": build_ddp()}
        optimizers = {name: build_optimizer(m, lr=1e-3, weight_decay=0.01) for name, m in models.items()}
        done = dict.fromkeys(models, 0)
        losses: dict[str, list[float]] = {name: [] for name in models}

        def step(name: str) -> None:
            batch, noise, flow_time = batches[done[name]]
            loss = models[name](batch, noise=noise, time=flow_time).loss
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            losses[name].append(loss.item())
            done[name] += 1

        for name in models:
            for _ in range(args.warmup):
                step(name)
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.blocks):  # interleaved: drift on shared cores hits both wrappers alike
            for name in models:
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    step(name)
                dist.barrier()
                times[name].append(time.perf_counter() - start)
        if rank == 0:
            params = sum(p.numel() for p in models["DDP"].parameters())
            torch.save({"times": times, "losses": losses, "params": params}, Path(folder) / "result.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per wrapper (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per wrapper first")
    args = parser.parse_args()
    print(f"# tiny pi0.5 training, {WORLD_SIZE} CPU ranks (gloo), 1 thread each, torch {torch.__version__}, "
          f"micro-batch {args.micro_batch} per rank, fp32, AdamW; median of {args.blocks} blocks of {args.steps} steps")
    try:
        with tempfile.TemporaryDirectory(prefix="embodyhpc-bench-") as folder:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ["OMP_NUM_THREADS"] = "1"
            start = time.perf_counter()
            mp.start_processes(rank_main, args=(folder, args), nprocs=WORLD_SIZE, start_method="spawn")
            result = torch.load(Path(folder) / "result.pt", weights_only=False)
            wall = time.perf_counter() - start
    except Exception as exc:  # a bench reports; it never fails the caller
        print(f"failed: {type(exc).__name__}: {exc}")
        return 0
    rate = {name: args.steps / statistics.median(t) for name, t in result["times"].items()}
    print(f"# {result['params'] / 1e6:.2f} M parameters; both ranks' processes ran {wall:.0f} s in all")
    print(f"{'wrapper':<8} {'steps/s':>8} {'samples/s':>10} {'ms/step':>8}")
    for name, value in rate.items():
        print(f"{name:<8} {value:>8.2f} {value * args.micro_batch * WORLD_SIZE:>10.1f} {1e3 / value:>8.1f}")
    print(f"FSDP2 / DDP steps/s: {rate['FSDP2'] / rate['DDP']:.2f}x (for the record; no goal)")
    fsdp, ddp = result["losses"]["FSDP2"], result["losses"]["DDP"]
    spread = max(abs(a - b) for a, b in zip(fsdp, ddp, strict=True))
    verdict = "agree" if spread <= 1e-4 * max(1.0, abs(ddp[0])) else "DIFFER (bug?)"
    print(f"losses of the two wrappers on rank 0 over {len(ddp)} steps {verdict} (max |diff| {spread:.1e}; "
          f"first {ddp[0]:.4f}, last {ddp[-1]:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
