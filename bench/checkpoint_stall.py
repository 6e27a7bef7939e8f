"""Training-loop stall of an async checkpoint save vs a synchronous save of the same ~400 MB state (Checkpointer).

    python bench/checkpoint_stall.py                    # 1 process, 33.6 M parameters + AdamW = 403 MB, ~30 s
    python bench/checkpoint_stall.py --ranks 2          # 2 gloo ranks, the same model sharded with FSDP2, ~1 min
    python bench/checkpoint_stall.py --width 1024 --reps 5 --dir /nvme/scratch

State: a stack of --layers Linear(--width, --width) layers (default 8 x 2048: 33.6 M fp32 parameters) with its
AdamW state (exp_avg, exp_avg_sq): 3 x 134 MB = 403 MB, saved through embodyhpc.checkpoint.Checkpointer into a
temp folder on the local disk (--dir; keep_latest_k=2, so at most two step folders exist). A training step:
forward and backward of a 32-row batch, AdamW, zero_grad (one thread per process). With --ranks 2 the layers
and the root are sharded with FSDP2 (fully_shard) over 2 processes (torch.multiprocessing, gloo, file://
rendezvous): each rank holds and writes half the state, and the Checkpointer runs its collectives on its own gloo
group, as in training.

One round: a training step; `save(step)` async (the default: DCP stages the state into CPU buffers and writes in a
background thread); --overlap training steps while the write runs; `wait()`; a training step; `save(step,
blocking=True)` (stage and write before returning: the baseline). The first round is a warm-up (it allocates the
Checkpointer's staging buffers, kept for the rest of the run, and the folder's first files); then --reps rounds.
Stall = wall time the training thread spends inside `save(...)` (the loop's own view; SaveResult.stall_s agrees).
Printed (medians; with 2 ranks the slower rank of each round): the async stall, the synchronous save, the ratio and
the goal (async stall <= 10 % of the synchronous save), the background write time of the async save (from its
marker), the time `wait()` still blocked after the overlap steps, and the training-step time while the write runs
vs without it (the write shares the machine's 2 cores). As a floor for the async stall (which is mostly the staging
copy), the time to copy_ each rank's state into buffers allocated beforehand is printed too (the slower rank).
It reports; it always exits 0.
Page cache: a 400 MB write lands in the page cache here, so the synchronous baseline is as fast as it can be;
on a parallel filesystem it is slower and the ratio better.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import nn

GOAL_RATIO = 0.10
BATCH_ROWS = 32


def build(args: argparse.Namespace, distributed: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    if distributed:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> float:
    start = time.perf_counter()
    model(inputs).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run_rank(rank: int, world_size: int, folder: str, args: argparse.Namespace) -> dict:
    """The rounds of the module doc on one rank; returns this rank's timings."""
    from embodyhpc.checkpoint import Checkpointer, read_marker
    from embodyhpc.checkpoint.layout import step_dir
    from embodyhpc.config.schema import CheckpointConfig

    torch.set_num_threads(1)
    distributed = world_size > 1
    model, optimizer = build(args, distributed)
    inputs = torch.randn(BATCH_ROWS, args.width, generator=torch.Generator().manual_seed(rank))
    root = Path(folder) / "checkpoints"
    ckpt = Checkpointer(root, CheckpointConfig(every_steps=1, keep_latest_k=2, async_save=True))
    out: dict[str, list[float]] = {k: [] for k in ("async", "sync", "wait", "write", "step", "step_in_flight")}
    step = 0
    try:
        for round_ in range(args.reps + 1):
            record = round_ > 0  # round 0: warm-up
            step += 1
            t = train_step(model, optimizer, inputs)
            start = time.perf_counter()
            result = ckpt.save(step, model, optimizer)
            async_s = time.perf_counter() - start
            async_step = step
            overlap = [train_step(model, optimizer, inputs) for _ in range(args.overlap)]
            wait_s = ckpt.wait()
            write_s = float(read_marker(step_dir(root, async_step))["wall_s"]) if rank == 0 else float("nan")
            step += args.overlap + 1
            plain = train_step(model, optimizer, inputs)
            start = time.perf_counter()
            ckpt.save(step, model, optimizer, blocking=True)
            sync_s = time.perf_counter() - start
            if record:
                assert result.is_async and abs(result.stall_s - async_s) < 0.05, result
                out["async"].append(async_s)
                out["sync"].append(sync_s)
                out["wait"].append(wait_s)
                out["write"].append(write_s)
                out["step"] += [t, plain]
                out["step_in_flight"] += overlap
    finally:
        ckpt.close()
    tensors = [_local(t) for t in (*model.state_dict().values(), *(v for s in optimizer.state.values()
                                                                      for v in s.values()))
               if isinstance(t, torch.Tensor)]
    local = sum(t.numel() * t.element_size() for t in tensors)
    # the floor of a stall that stages a CPU copy: copy_ of this rank's state into buffers allocated beforehand
    buffers = [torch.empty_like(t) for t in tensors]
    for buffer, t in zip(buffers, tensors, strict=True):
        buffer.copy_(t)
    copies = []
    for _ in range(3):
        start = time.perf_counter()
        for buffer, t in zip(buffers, tensors, strict=True):
            buffer.copy_(t)
        copies.append(time.perf_counter() - start)
    return {"bytes": local, "copy": statistics.median(copies), **out}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2), the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def rank_main(rank: int, world_size: int, folder: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))
    try:
        result = run_rank(rank, world_size, folder, args)
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="processes (2: FSDP2 over gloo)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5, help="timed rounds after the warm-up (median reported)")
    parser.add_argument("--overlap", type=int, default=3, help="training steps while an async save is in flight")
    parser.add_argument("--dir", default=None, help="where the temp checkpoint folder goes (default: $TMPDIR)")
    args = parser.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    print(f"# Checkpointer save stall, torch {torch.__version__}, {args.ranks} rank(s), 1 thread each: "
          f"{args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.1f} M parameters + AdamW "
          f"= {3 * params * 4 / 1e6:.0f} MB of state; median of {args.reps} rounds after 1 warm-up")
    try:
        with tempfile.TemporaryDirectory(prefix="embodyhpc-bench-ckpt-", dir=args.dir) as folder:
            if args.ranks == 1:
                with warnings.catch_warnings():  # DCP warns on every call without a process group: the mode here
                    warnings.filterwarnings("ignore", "torch.distributed is disabled")
                    results = [run_rank(0, 1, folder, args)]
            else:
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
                os.environ["OMP_NUM_THREADS"] = "1"
                mp.start_processes(rank_main, args=(args.ranks, folder, args), nprocs=args.ranks,
                                   start_method="spawn")
                results = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    except Exception as exc:  # a bench reports; it never fails the caller
        print(f"failed: {type(exc).__name__}: {exc}")
        return 0

    def per_round(key: str) -> list[float]:  # the slower rank of each round
        return [max(values) for values in zip(*(r[key] for r in results), strict=True)]

    median = {key: statistics.median(per_round(key)) for key in ("async", "sync", "wait")}
    write = statistics.median(results[0]["write"])
    step, in_flight = (statistics.median(v) for r in results[:1] for v in (r["step"], r["step_in_flight"]))
    total_mb = sum(r["bytes"] for r in results) / 1e6
    ratio = median["async"] / median["sync"]
    print(f"# state held: {total_mb:.0f} MB over {args.ranks} rank(s) (parameters + AdamW exp_avg, exp_avg_sq)")
    print(f"{'metric':<62} {'value':>9}")
    print(f"{'synchronous save: stall = save(blocking=True) (baseline)':<62} {median['sync']:>8.3f}s")
    print(f"{'async save: stall = time inside save()':<62} {median['async']:>8.3f}s")
    print(f"{'async stall / synchronous save':<62} {ratio:>8.1%}  <= {GOAL_RATIO:.0%}: "
          f"{'ok' if ratio <= GOAL_RATIO else 'OVER'}")
    copy = max(r["copy"] for r in results)
    print(f"{'  floor: copy_ of the state into preallocated buffers':<62} {copy:>8.3f}s  "
          f"({copy / median['sync']:.1%} of the synchronous save)")
    print(f"{'async save: background write until marked (marker wall_s)':<62} {write:>8.3f}s")
    print(f"{f'async save: wait() still blocked after {args.overlap} overlapping steps':<62} {median['wait']:>8.3f}s")
    print(f"{'training step, no save in flight (rank 0)':<62} {step:>8.3f}s")
    print(f"{'training step, async write in flight (rank 0)':<62} {in_flight:>8.3f}s  ({in_flight / step:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
