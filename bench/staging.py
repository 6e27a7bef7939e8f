"""stage() vs `cp -r` on many small files and on a few large ones: first stage, restage, restage % of first.

    python bench/staging.py                          # 10,000 files of 1-16 KiB; 20 files of 50 MiB
    python bench/staging.py --only small --files 50000 --workers 16 --repeats 5 --tmp /nvme/scratch
    python bench/staging.py --only small --latency-ms 0.5 --workers 16   # source behind a metadata delay (root)

For each set, each repeat copies the same source into fresh destinations with `cp -r` (a subprocess with an
argument list), with `cp -r` followed by `sync` (stage syncs the destination's filesystem before its manifest
lists a file, so this is the like-for-like baseline for durability), and with `stage(src, dest)` in the
default verify="quick" (every byte hashed while it is copied, no re-read) and in verify="full" (the whole
staged copy re-read from the device afterwards). Then it restages the unchanged source into each staged copy:
quick is a stat walk (no file is read), full re-hashes every staged file. Medians of --repeats, interleaved.

The source was just written, so it is in the page cache and the destination is on the same local filesystem;
nothing is dropped from the cache (that needs root). This favours `cp -r`: with no I/O latency to hide, a copy
is per-file syscalls plus CPU, and staging adds a hash of every byte (XXH3) and the manifest, in Python, on cores it
shares with its own threads. On a parallel filesystem each open/stat/read waits on a metadata or object server,
which is where staging's threads pay off. --latency-ms puts the source behind bench/latency_fs.py, a read-only
FUSE view that answers every lookup, stat, open and readdir after that delay (a parallel filesystem's metadata
round trip; data reads are not delayed) and caches nothing in the kernel: both `cp -r` and stage read through it.
It needs root, /dev/fuse, libfuse2 and fusepy (`apt-get install libfuse2; pip install fusepy`).
Goals: first stage >= 2x as fast as cp -r; restage <= 2 % of the first stage. Without --latency-ms it also prints
what bounds both here (print_limits): cp's kernel CPU spread over every CPU, and a stat-only walk of both trees.
The bench reports; it exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

GOAL_SPEEDUP_VS_CP = 2.0
GOAL_RESTAGE_FRACTION = 0.02
FILES_PER_FOLDER = 100


def make_source(root: Path, num_files: int, min_bytes: int, max_bytes: int, seed: int) -> int:
    """num_files files of random sizes and bytes in folders of FILES_PER_FOLDER; returns total bytes."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(min_bytes, max_bytes + 1, size=num_files)
    blob = rng.bytes(int(max_bytes) + num_files)  # files are windows of one random blob: cheap, all distinct
    for i, size in enumerate(sizes.tolist()):
        folder = root / f"chunk-{i // FILES_PER_FOLDER:04d}"
        if i % FILES_PER_FOLDER == 0:
            folder.mkdir(parents=True)
        (folder / f"file-{i:06d}.bin").write_bytes(blob[i:i + size])
    return int(sizes.sum())


def make_large_source(root: Path, num_files: int, file_bytes: int, seed: int) -> int:
    rng = np.random.default_rng(seed)
    blob = rng.bytes(file_bytes + num_files)
    root.mkdir(parents=True)
    for i in range(num_files):
        (root / f"episode-{i:03d}.hdf5").write_bytes(blob[i:i + file_bytes])
    return num_files * file_bytes


@contextlib.contextmanager
def delayed_view(src: Path, mountpoint: Path, latency_ms: float) -> Iterator[Path]:
    """`src` seen through bench/latency_fs.py at `mountpoint` while the block runs."""
    mountpoint.mkdir()
    log = mountpoint.with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("latency_fs.py")), str(src),
                                 str(mountpoint), "--latency-ms", str(latency_ms)], stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 20
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the FUSE view did not mount (needs root, /dev/fuse, libfuse2, fusepy): "
                                   f"{log.read_text()[-500:]}")
            time.sleep(0.1)
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=False)
        proc.terminate()
        proc.wait(timeout=20)


def stat_walk(*roots: Path) -> None:
    """One lstat of every entry under each root: what any restage that can see an in-place edit must do."""
    stack = [str(root) for root in roots]
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                else:
                    entry.stat(follow_symlinks=False)


def children_cpu_s() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime, usage.ru_stime


def timed(fn) -> float:
    # Flush earlier cases' dirty pages first (untimed): otherwise their writeback lands in this case's time.
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def print_limits(cp: float, cp_cpu: list[tuple[float, float]], floor: float, stage_quick: float) -> None:
    """What no copier and no restage can beat on this machine (no latency to hide), from the same runs."""
    user, system = (statistics.median(x) for x in zip(*cp_cpu, strict=True))
    cpus = os.cpu_count() or 1
    bound = cp / max(system / cpus, 1e-9)
    print(f"# bound: cp -r spent {user:.2f} s user + {system:.2f} s system CPU per run ({system / (user + system):.0%} "
          f"in the kernel); with no latency to hide, a copier issuing the same kernel work on {cpus} CPUs in "
          f"perfect parallel, with no hashing or bookkeeping, reaches at most {bound:.2f}x cp -r")
    print(f"# floor: one lstat of every source and staged file (one thread; any restage that notices an in-place edit "
          f"does at least this) {floor * 1e3:.1f} ms = {floor / stage_quick:.1%} of stage quick")


def run_set(label: str, src: Path, tmp: Path, num_files: int, num_bytes: int, args: argparse.Namespace) -> None:
    from embodyhpc.staging import stage

    cases = ("cp -r", "cp -r + sync", "stage quick", "stage full", "restage quick", "restage full")
    times: dict[str, list[float]] = {name: [] for name in cases}
    results: dict[str, object] = {}
    cp_cpu: list[tuple[float, float]] = []  # (user, system) CPU seconds of each plain `cp -r`
    floor_s: list[float] = []  # the stat-only walk of print_limits

    def run_cp(dest: Path) -> None:
        before = children_cpu_s()
        subprocess.run(["cp", "-r", str(src), str(dest)], check=True)
        after = children_cpu_s()
        cp_cpu.append((after[0] - before[0], after[1] - before[1]))

    def run_stage(name: str, dest: Path, verify: str) -> None:
        results[name] = stage(src, dest, workers=args.workers, verify=verify, progress=False)

    for r in range(args.repeats):  # interleaved, so drift on shared cores hits every case alike
        dests = {name: tmp / f"{label}-{name.replace(' ', '-').replace('+', 'and')}-{r}" for name in cases[:4]}
        first = {
            "cp -r": lambda d=dests["cp -r"]: run_cp(d),
            "cp -r + sync": lambda d=dests["cp -r + sync"]: (
                subprocess.run(["cp", "-r", str(src), str(d)], check=True), os.sync()),
            "stage quick": lambda d=dests["stage quick"]: run_stage("stage quick", d, "quick"),
            "stage full": lambda d=dests["stage full"]: run_stage("stage full", d, "full"),
        }
        order = list(first)[r % 4:] + list(first)[:r % 4]  # rotated: no case always runs first after a cleanup
        for name in order:
            times[name].append(timed(first[name]))
        times["restage quick"].append(timed(lambda d=dests["stage quick"]: run_stage("restage quick", d, "quick")))
        times["restage full"].append(timed(lambda d=dests["stage full"]: run_stage("restage full", d, "full")))
        floor_s.append(timed(lambda d=dests["stage quick"]: stat_walk(src, d)))
        for folder in dests.values():
            shutil.rmtree(folder)
    median_s = {name: statistics.median(t) for name, t in times.items()}
    min_s = {name: min(t) for name, t in times.items()}

    behind = f", source behind {args.latency_ms:g} ms metadata latency (FUSE)" if args.latency_ms > 0 else ""
    print(f"\n## {label}: {num_files} files, {num_bytes / 2**20:.1f} MiB{behind}; stage(workers={args.workers}); "
          f"median of {args.repeats}; {os.cpu_count()} CPUs")
    for name in ("restage quick", "restage full"):
        res = results[name]
        print(f"# last {name}: {res.num_files_copied} copied, {res.num_files_skipped} unchanged, "
              f"{res.num_files_rehashed} re-hashed")
    print("# seconds per run: " + "; ".join(f"{name} {', '.join(f'{t:.3f}' for t in ts)}"
                                              for name, ts in times.items()))
    cp, cp_sync = median_s["cp -r"], median_s["cp -r + sync"]
    print(f"{'case':<15} {'median s':>9} {'MiB/s':>8} {'x cp -r':>8} {'x cp+sync':>9}  goal (on medians)")
    for name, seconds in median_s.items():
        goal = ""
        if name.startswith("stage"):
            goal = f">= {GOAL_SPEEDUP_VS_CP:g}x cp -r: {'ok' if cp / seconds >= GOAL_SPEEDUP_VS_CP else 'BELOW'}"
        elif name.startswith("restage"):
            fraction = seconds / median_s["stage " + name.split()[1]]
            goal = (f"{fraction:.1%} of first stage ({name.split()[1]}), <= {GOAL_RESTAGE_FRACTION:.0%}: "
                    f"{'ok' if fraction <= GOAL_RESTAGE_FRACTION else 'BELOW'}")
        rate = f"{num_bytes / 2**20 / seconds:8.1f}" if not name.startswith("restage") else f"{'-':>8}"
        print(f"{name:<15} {seconds:9.3f} {rate} {cp / seconds:7.2f}x {cp_sync / seconds:8.2f}x  {goal}")
    if args.latency_ms <= 0:
        print_limits(cp, cp_cpu, statistics.median(floor_s), median_s["stage quick"])
    # On a shared machine the fastest run is the least disturbed one: the same ratios on best-of-N times.
    best = {name: min_s["cp -r"] / t for name, t in min_s.items()}
    print("# best-of-N ratios: " + ", ".join(f"{name} {best[name]:.2f}x cp -r" for name in cases[1:4])
          + f"; restage quick {min_s['restage quick'] / min_s['stage quick']:.1%} of stage quick"
          + f", restage full {min_s['restage full'] / min_s['stage full']:.1%} of stage full")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("small", "large"), help="run one set only")
    parser.add_argument("--files", type=int, default=10_000, help="small set: number of files")
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=16 * 1024)
    parser.add_argument("--large-files", type=int, default=20, help="large set: number of files")
    parser.add_argument("--large-mib", type=int, default=50, help="large set: MiB per file")
    parser.add_argument("--workers", type=int, default=8, help="stage() copy threads (its default: 8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case; medians are reported")
    parser.add_argument("--tmp", type=Path, help="where to create the temp dir (default: the system temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="read the source through a FUSE view that delays every metadata request this long")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    print("# source page-cached (just written), destination on the same local filesystem: this favours cp -r "
          "(no I/O latency for threads to hide); see the module docstring")
    with tempfile.TemporaryDirectory(prefix="bench-staging-", dir=args.tmp) as tmp_name:
        tmp = Path(tmp_name)
        sets = []
        if args.only in (None, "small"):
            src = tmp / "small-src"
            sets.append(("small", src, args.files, make_source(src, args.files, args.min_bytes, args.max_bytes,
                                                               args.seed)))
        if args.only in (None, "large"):
            src = tmp / "large-src"
            sets.append(("large", src, args.large_files,
                         make_large_source(src, args.large_files, args.large_mib * 2**20, args.seed)))
        for label, src, num_files, num_bytes in sets:
            if args.latency_ms > 0:
                with delayed_view(src, tmp / f"{label}-view", args.latency_ms) as view:
                    run_set(f"{label}-delayed", view, tmp, num_files, num_bytes, args)
            else:
                run_set(label, src, tmp, num_files, num_bytes, args)
            shutil.rmtree(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
