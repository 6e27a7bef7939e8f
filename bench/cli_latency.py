"""CLI start-up latency against `python -c pass` (the floor), median of N runs.

    python bench/cli_latency.py [--runs 15]

Goals: `embodyhpc --help` <= 0.25 s and `embodyhpc render` <= 0.5 s (no torch on those paths).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXE = Path(sys.executable).with_name("embodyhpc")
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "embodyhpc --help": [str(EXE), "--help"],
    "embodyhpc recipes list": [str(EXE), "recipes", "list"],
    "embodyhpc render pi05_fp8": [str(EXE), "render", "pi05_fp8", "--site", "example_ib", "data.root=/d",
                                  "model.tokenizer_path=/m/tok.model",
                                  "site.account=a"],
}
GOALS_S = {"embodyhpc --help": 0.25, "embodyhpc render pi05_fp8": 0.5}


def median_s(cmd: list[str], runs: int) -> float:
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    for cmd in CASES.values():  # warm the page cache and .pyc files
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    results = {name: median_s(cmd, args.runs) for name, cmd in CASES.items()}
    base = results["python -c pass"]
    print(f"{'command':<28} {'median s':>9} {'x python':>9} {'goal s':>7}")
    failed = False
    for name, seconds in results.items():
        goal = GOALS_S.get(name)
        mark = "" if goal is None else ("ok" if seconds <= goal else "OVER")
        failed |= mark == "OVER"
        print(f"{name:<28} {seconds:9.3f} {seconds / base:9.1f} {goal or '':>7} {mark}")
    if failed:
        print("(a goal is over: benchmarks report, they do not fail the build)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
