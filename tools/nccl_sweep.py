#!/usr/bin/env python3
"""All-reduce / all-gather bandwidth sweep over NCCL (or Gloo) environment variants, one srun step per variant.

    python tools/nccl_sweep.py --nodes 2 --variant base: --variant qps4:NCCL_IB_QPS_PER_CONNECTION=4 \\
        --site example_ib --sizes 1KiB,1MiB,64MiB --backend nccl --srun-arg=--gpus-per-node=1 [--json]

Every variant is a set of environment variables (`--variant NAME:KEY=VAL,KEY=VAL`, repeatable, or
`--site NAME` for the variables a site profile's `network:` section exports). NCCL reads its variables
once, when the communicator is created, so each variant runs in fresh processes: the driver (this script
without --worker, on a login node or inside an allocation) launches
`srun -N <nodes> --ntasks-per-node=1 python tools/nccl_sweep.py --worker ...` with the variant's variables
in srun's environment (srun exports the caller's environment to the tasks), and reads the one result line
rank 0 prints. It then prints a table per (variant, op, size) and the best variant.

Bandwidths are in decimal GB/s and follow the definitions nccl-tests publishes, so the numbers compare with
theirs. `size` is the bytes one collective produces on each rank: the reduced tensor for all_reduce, the whole
gathered output (all ranks' parts) for all_gather.
  - algorithm bandwidth (algbw) = size / time of one collective;
  - bus bandwidth (busbw) rescales algbw to what each rank's link actually carried, which makes it comparable
    across rank counts and with the hardware's link speed. In a ring all-reduce, each rank sends (and receives)
    2(n-1)/n of the buffer: (n-1)/n while reduce-scattering and again while all-gathering the reduced pieces,
    hence busbw = algbw * 2(n-1)/n. In an all-gather each rank receives the n-1 parts it does not own, (n-1)/n
    of the output, hence busbw = algbw * (n-1)/n. With one rank nothing moves and busbw is 0.
The time of a collective is the slowest rank's mean over the timed iterations.

The local 2-node test cluster runs it with `--backend gloo` (CPU tensors over TCP): the mechanics, not
fabric numbers. Operator tool: running srun from here is intended (the embodyhpc library never does).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

OPS = ("all_reduce", "all_gather")
RESULT_MARK = "NCCL_SWEEP_RESULT "
DEFAULT_SIZES = "1KiB,16KiB,256KiB,4MiB,64MiB"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KIB": 1 << 10, "KB": 1000, "M": 1 << 20, "MIB": 1 << 20, "MB": 1000**2,
          "G": 1 << 30, "GIB": 1 << 30, "GB": 1000**3}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---------------------------------------------------------------- pure helpers (unit-tested)

def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 1KiB, 64MiB, 4096)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def format_size(num_bytes: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor} {unit}"
    return f"{num_bytes} B"


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'NAME:KEY=VAL,KEY=VAL' (or 'NAME:' for the environment as it is) -> (NAME, {KEY: VAL}).

    Values are held to the ranges a site profile's are (embodyhpc.config.nccl_values): NCCL would clamp, mask or
    misread the others, and the variant would measure something other than its name says."""
    from embodyhpc.config import nccl_values
    from embodyhpc.errors import ConfigError

    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"variant {text!r}: expected NAME:KEY=VAL,KEY=VAL")
    env: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not _ENV_NAME.match(key):
            raise ValueError(f"variant {name}: {item!r} is not KEY=VAL")
        env[key] = value
    try:
        nccl_values.check_environment(env, lambda key: key)
    except ConfigError as exc:
        raise ValueError(f"variant {name}: {exc.message}") from None
    return name.strip(), env


def site_variant(site: str) -> tuple[str, dict[str, str]]:
    """The variables a site profile's network section exports (shipped name or a YAML path)."""
    from embodyhpc.config.load import find_recipe
    from embodyhpc.config.network import NetworkConfig
    from embodyhpc.config.yamlio import load_yaml

    data = load_yaml(find_recipe(site, subdir="sites").text) or {}
    return f"site:{Path(site).stem}", NetworkConfig(**(data.get("network") or {})).environment()


def alg_bandwidth(size_bytes: int, seconds: float) -> float:
    """GB/s (decimal, as nccl-tests)."""
    return size_bytes / seconds / 1e9 if seconds > 0 else 0.0


def bus_bandwidth(op: str, algbw: float, world_size: int) -> float:
    n = world_size
    if op == "all_reduce":
        return algbw * 2 * (n - 1) / n
    if op == "all_gather":
        return algbw * (n - 1) / n
    raise ValueError(f"unknown op {op!r}")


def best_variant(results: list[dict]) -> dict | None:
    """The variant with the highest mean bus bandwidth at the larger half of the sizes (where bandwidth, not
    latency, dominates), over all ops; None without results."""
    sizes = sorted({r["size_bytes"] for r in results})
    if not sizes:
        return None
    large = set(sizes[len(sizes) // 2:])
    scores: dict[str, list[float]] = {}
    for r in results:
        if r["size_bytes"] in large:
            scores.setdefault(r["variant"], []).append(r["busbw_gbps"])
    name, values = max(scores.items(), key=lambda kv: sum(kv[1]) / len(kv[1]))
    return {"variant": name, "score_gbps": sum(values) / len(values), "sizes_bytes": sorted(large)}


def format_table(results: list[dict], best: dict | None = None) -> str:
    header = (f"{'variant':<16} {'op':<10} {'size':>10} {'iters':>5} {'time_us':>12} {'algbw GB/s':>11} "
              f"{'busbw GB/s':>11}")
    lines = [header, "-" * len(header)]
    for r in results:
        lines.append(f"{r['variant']:<16} {r['op']:<10} {format_size(r['size_bytes']):>10} {r['iters']:>5} "
                     f"{r['time_s'] * 1e6:>12.1f} {r['algbw_gbps']:>11.3f} {r['busbw_gbps']:>11.3f}")
    if best is not None:
        lines.append(f"best: {best['variant']} (mean bus bandwidth {best['score_gbps']:.3f} GB/s at "
                     f"{', '.join(format_size(s) for s in best['sizes_bytes'])})")
    return "\n".join(lines)


# ---------------------------------------------------------------- worker (one per node, under srun)

def _rendezvous() -> tuple[int, int, int, str, int]:
    """(rank, world size, local rank, master address, port) from Slurm's step variables, else torchrun's."""
    env = os.environ
    if "SLURM_PROCID" in env and "SLURM_STEP_NODELIST" in env:
        nodes = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_STEP_NODELIST"]], check=True,
                               capture_output=True, text=True).stdout.split()
        step = f"{env.get('SLURM_JOB_ID', '0')}.{env.get('SLURM_STEP_ID', '0')}"
        port = 20000 + zlib.crc32(step.encode()) % 20000  # same on every task, different per step
        return (int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", "0")),
                nodes[0], port)
    return (int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")),
            env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29517")))


def run_worker(sizes: list[int], ops: list[str], backend: str, warmup: int, iters: int, budget_s: float,
               variant_keys: list[str]) -> dict | None:
    """Measure every (op, size); rank 0 returns the results (other ranks None)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world, local_rank, master, port = _rendezvous()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def slowest(value: float) -> float:
        box = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return float(box.item())

    results = []
    try:
        for op in ops:
            for size in sizes:
                per_rank = max(1, size // 4 // (world if op == "all_gather" else 1))  # float32 elements
                inp = torch.ones(per_rank, dtype=torch.float32, device=device)
                if op == "all_reduce":
                    def run_once(t=inp) -> None:
                        dist.all_reduce(t)
                    size_bytes = per_rank * 4
                else:
                    out = torch.empty(per_rank * world, dtype=torch.float32, device=device)
                    parts = list(out.chunk(world))

                    def run_once(i=inp, o=out, p=parts) -> None:
                        if backend == "nccl":
                            dist.all_gather_into_tensor(o, i)
                        else:
                            dist.all_gather(p, i)
                    size_bytes = per_rank * 4 * world
                for _ in range(warmup):
                    run_once()
                sync()
                # the iteration count must be the same on every rank: derive it from the slowest rank's probe
                start = time.perf_counter()
                run_once()
                sync()
                probe = slowest(time.perf_counter() - start)
                count = max(1, min(iters, int(budget_s / max(probe, 1e-9))))
                dist.barrier()
                start = time.perf_counter()
                for _ in range(count):
                    run_once()
                sync()
                seconds = slowest((time.perf_counter() - start) / count)
                algbw = alg_bandwidth(size_bytes, seconds)
                results.append({"op": op, "size_bytes": size_bytes, "iters": count, "time_s": seconds,
                                "algbw_gbps": algbw, "busbw_gbps": bus_bandwidth(op, algbw, world)})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    return {"world_size": world, "backend": backend, "torch": torch.__version__, "nodes": _node_names(),
            "env_seen": {k: os.environ.get(k) for k in variant_keys}, "results": results}


def _node_names() -> str | None:
    return os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")


# ---------------------------------------------------------------- driver

def run_variant(name: str, env: dict[str, str], args: argparse.Namespace) -> dict:
    """One srun step with `env` added to this process's environment; the worker's result dict (or an error)."""
    command = ["srun", f"--nodes={args.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
               f"--job-name=nccl-sweep-{name}", f"--time={args.time}"]
    if args.partition:
        command.append(f"--partition={args.partition}")
    command += args.srun_arg or []
    command += [args.python, str(Path(__file__).resolve()), "--worker", "--sizes", args.sizes, "--ops", args.ops,
                "--backend", args.backend, "--warmup", str(args.warmup), "--iters", str(args.iters),
                "--budget-s", str(args.budget_s), "--variant-keys", ",".join(env)]
    try:
        proc = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=args.step_timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"srun: {exc}"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK):])
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
    return {"error": f"srun exited {proc.returncode} without a result: {tail}"}


def sweep(variants: list[tuple[str, dict[str, str]]], args: argparse.Namespace) -> dict:
    results, errors, seen = [], {}, {}
    for name, env in variants:
        out = run_variant(name, env, args)
        if "error" in out:
            errors[name] = out["error"]
            print(f"[nccl_sweep] variant {name} failed: {out['error']}", file=sys.stderr, flush=True)
            continue
        seen[name] = out["env_seen"]
        results += [{"variant": name, "world_size": out["world_size"], **r} for r in out["results"]]
        print(f"[nccl_sweep] variant {name}: {len(out['results'])} measurements on {out['nodes']}",
              file=sys.stderr, flush=True)
    best = best_variant(results)
    if best is not None:
        best["env"] = dict(variants)[best["variant"]]
    return {"nodes": args.nodes, "backend": args.backend, "sizes_bytes": [parse_size(s) for s in args.sizes.split(",")],
            "ops": args.ops.split(","), "variants": {n: e for n, e in variants}, "env_seen": seen,
            "results": results, "best": best, "errors": errors}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", default=[], help="NAME:KEY=VAL,KEY=VAL (repeatable)")
    parser.add_argument("--site", action="append", default=[], help="a site profile whose network section is a variant")
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--ops", default=",".join(OPS), help="all_reduce,all_gather")
    parser.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--partition")
    parser.add_argument("--time", default="10", help="srun --time per variant (minutes or [HH:]MM:SS)")
    parser.add_argument("--srun-arg", action="append", help="extra srun argument, e.g. --srun-arg=--gpus-per-node=1")
    parser.add_argument("--python", default=sys.executable, help="Python on the compute nodes")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size, at most")
    parser.add_argument("--budget-s", type=float, default=1.0, help="timed seconds per size, about")
    parser.add_argument("--step-timeout-s", type=float, default=900.0)
    parser.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant-keys", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for op in args.ops.split(","):
        if op not in OPS:
            parser.error(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    try:
        [parse_size(s) for s in args.sizes.split(",")]
        args.variants = [parse_variant(v) for v in args.variant] + [site_variant(s) for s in args.site]
    except ValueError as exc:
        parser.error(str(exc))
    names = [n for n, _ in args.variants]
    if len(set(names)) != len(names):
        parser.error(f"variant names must differ: {names}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.worker:
        out = run_worker(sizes, args.ops.split(","), args.backend, args.warmup, args.iters, args.budget_s,
                         [k for k in args.variant_keys.split(",") if k])
        if out is not None:
            print(RESULT_MARK + json.dumps(out), flush=True)
        return 0
    report = sweep(args.variants or [("current", {})], args)
    print(json.dumps(report, indent=2) if args.json else format_table(report["results"], report["best"]))
    return 1 if report["errors"] or not report["results"] else 0


if __name__ == "__main__":
    sys.exit(main())
