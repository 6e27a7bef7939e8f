"""stage() of many small files vs `cp -r`, and a restage of unchanged data vs the first stage.

    python bench/staging.py                         # 10,000 files of 1-16 KiB in 100 folders, in a temp dir
    python bench/staging.py --files 50000 --workers 16 --repeats 5 --tmp /nvme/scratch

Each repeat copies the same source into a fresh destination with `cp -r` (a subprocess with an argument list),
with `stage(src, dest)` as shipped (8 threads, verify=True: every staged file re-hashed afterwards) and with
`stage(..., verify=False)` (no re-read, like cp), then restages the unchanged source into the staged copy
as shipped (verify=True re-hashes the whole staged copy again) and with verify=False (stat only: the copy was
verified on the first run and stays marked so). Medians of --repeats runs, interleaved.

The source was just written, so it is in the page cache and the destination is on the same local filesystem;
nothing is dropped from the cache (that needs root tricks). This favours `cp -r`: with no I/O latency to hide,
a copy is per-file syscalls plus CPU, and staging adds per-file work cp does not do (BLAKE2b of every byte,
copy to a partial name + rename, the manifest, the re-hash of verify) on 2 cores shared with its threads.
On a parallel filesystem each open/stat/read waits milliseconds on a metadata or object server, which is where
staging's copy threads pay off; this bench does not simulate that.
Goals: stage >= 2x as fast as cp -r; restage <= 2 % of the first stage. The bench reports; it always exits 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
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


def timed(fn) -> float:
    # Flush earlier cases' dirty pages first (untimed): otherwise their writeback lands in this case's time.
    # Neither cp nor stage fsyncs, so each case is timed writing into the page cache.
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=16 * 1024)
    parser.add_argument("--workers", type=int, default=8, help="stage() copy threads (its default: 8)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each case; medians are reported")
    parser.add_argument("--tmp", type=Path, help="where to create the temp dir (default: the system temp dir)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    from embodyhpc.data.staging import stage

    with tempfile.TemporaryDirectory(prefix="bench-staging-", dir=args.tmp) as tmp_name:
        tmp = Path(tmp_name)
        src = tmp / "src"
        num_bytes = make_source(src, args.files, args.min_bytes, args.max_bytes, args.seed)
        times: dict[str, list[float]] = {"cp -r": [], "stage": [], "stage verify=False": [], "restage": [],
                                         "restage verify=False": []}
        results = {}
        for r in range(args.repeats):  # interleaved, so drift on shared cores hits every case alike
            cp_dest, dest, dest_noverify = tmp / f"cp-{r}", tmp / f"stage-{r}", tmp / f"stage-nv-{r}"
            times["cp -r"].append(timed(lambda d=cp_dest: subprocess.run(["cp", "-r", str(src), str(d)],
                                                                           check=True)))
            times["stage"].append(timed(lambda d=dest: results.__setitem__(
                "stage", stage(src, d, workers=args.workers, progress=False))))
            times["stage verify=False"].append(timed(lambda d=dest_noverify: stage(
                src, d, workers=args.workers, verify=False, progress=False)))
            times["restage"].append(timed(lambda d=dest: results.__setitem__(
                "restage", stage(src, d, workers=args.workers, progress=False))))
            times["restage verify=False"].append(timed(lambda d=dest: results.__setitem__(
                "restage verify=False", stage(src, d, workers=args.workers, verify=False, progress=False))))
            for folder in (cp_dest, dest, dest_noverify):
                shutil.rmtree(folder)
        median_s = {name: statistics.median(t) for name, t in times.items()}

    print(f"# {args.files} files, {num_bytes / 2**20:.1f} MiB ({args.min_bytes}-{args.max_bytes} bytes each) in "
          f"{-(-args.files // FILES_PER_FOLDER)} folders; stage(workers={args.workers}); median of {args.repeats}; "
          f"{os.cpu_count()} CPUs")
    print("# source page-cached (just written), destination on the same local filesystem: this favours cp -r "
          "(no I/O latency for threads to hide); see the module docstring")
    for name in ("restage", "restage verify=False"):
        print(f"# last {name}: {results[name].num_files_copied} copied, {results[name].num_files_skipped} unchanged"
              f", {'re-hashed every staged file' if results[name].verified else 'stat only'}")
    print("# seconds per run: " + "; ".join(f"{name} {', '.join(f'{t:.2f}' for t in ts)}"
                                              for name, ts in times.items()))
    base = median_s["cp -r"]
    print(f"{'case':<20} {'median s':>9} {'files/s':>9} {'MiB/s':>7} {'x cp -r':>8}  goal")
    for name, seconds in median_s.items():
        goal = ""
        if name == "stage":
            speedup = base / seconds
            goal = f">= {GOAL_SPEEDUP_VS_CP:g}x cp -r: {'ok' if speedup >= GOAL_SPEEDUP_VS_CP else 'BELOW'}"
        elif name.startswith("restage"):
            fraction = seconds / median_s["stage"]
            goal = (f"{fraction:.1%} of first stage, <= {GOAL_RESTAGE_FRACTION:.0%}: "
                    f"{'ok' if fraction <= GOAL_RESTAGE_FRACTION else 'BELOW'}")
        elif name == "cp -r":
            goal = "(baseline)"
        copies = not name.startswith("restage")
        rate = f"{args.files / seconds:9.0f} {num_bytes / 2**20 / seconds:7.1f}" if copies else f"{'-':>9} {'-':>7}"
        print(f"{name:<20} {seconds:9.3f} {rate} {base / seconds:7.2f}x  {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
