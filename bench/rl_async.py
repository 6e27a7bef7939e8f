"""RL pipeline throughput: the asynchronous pipeline (rl.async: true, RL-VLA3's three levels) against the synchronous
one (rl.async: false), on the same processes and cores, with and without a deliberately slow env worker.

    python bench/rl_async.py                                    # builds a few-shot SFT policy first (~3 min)
    python bench/rl_async.py --init-weights RUN/export --data DEMOS   # an SFT export and its demonstrations
    python bench/rl_async.py --iterations 8 --straggler-delay 0.02 --env-workers 2 --eval-episodes 24

Each case is `embodyhpc submit recipes/rl_metaworld_cpu.yaml --local` (the three roles as local processes: actor,
rollout worker, env workers) from the same SFT export, for the same number of policy versions. Read from the run's
logs/metrics.jsonl (one line per version): env steps/s = the environment steps of all versions over their summed
step time; actor samples/s = the chunk samples the actor admitted over the same time; and the RL job's wall time.
The straggler: env worker 0 sleeps --straggler-delay seconds per environment step (rl.straggler_delay_s), so the
synchronous rounds wait for it while the asynchronous pipeline keeps the other env worker's envs and the actor busy.
"Final success" is the last two versions' env/success_once on the training seeds, or, with --eval-episodes N, the
held-out evaluation of the final policy (eval.seeds [100]) with its Wilson interval: the two pipelines must end at
equal success for the speed-up to count.

Goal (issue 31): async >= 1.5x sync with a straggler and >= 1.2x without, at equal final success. On 2 cores the
roles (2 env workers, 1 rollout worker, 1 actor rank) share the cores, so overlap can only hide waiting, not add
compute: what async wins here is the time the synchronous rounds spend waiting for the slowest env and for the
actor's step. The bench reports; it always exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/rl_metaworld_cpu.yaml"
GOALS = {True: 1.5, False: 1.2}  # with a straggler, without


def cli(*args: str, timeout_s: float = 3600) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    result = subprocess.run([sys.executable, "-m", "embodyhpc.cli.main", *args], capture_output=True, text=True,
                            env=env, timeout=timeout_s, cwd=REPO)
    if result.returncode != 0:
        sys.exit(f"embodyhpc {' '.join(args[:2])} failed ({result.returncode}):\n{result.stdout[-2000:]}\n"
                 f"{result.stderr[-2000:]}")
    return result


def run_dir_of(stdout: str) -> Path:
    """The run directory from `embodyhpc submit --json` output (one JSON document)."""
    return Path(json.loads(stdout)["run_dir"])


def build_sft(out: Path) -> tuple[Path, Path]:
    """20 reach-v3 demonstrations and a 150-step tiny pi0.5 trained on them (what tests/rl/test_rl_closed_loop.py
    starts from): its export folder and the demonstrations."""
    from embodyhpc.sim.metaworld import generate_demos

    os.environ.setdefault("MUJOCO_GL", "egl")
    demos = out / "reach"
    generate_demos(demos, tasks=["reach-v3"], episodes_per_task=20, seed=0, image_size=32, progress=False)
    result = cli("submit", "recipes/demo_metaworld_cpu.yaml", "--local", "--json", f"job.runs_root={out}",
                 f"data.root={demos}", "train.steps=150", "train.warmup_steps=20", "eval.enabled=false",
                 "eval.tasks=[reach-v3]", "resources.nodes=1", "checkpoint.every_steps=1000")
    return run_dir_of(result.stdout) / "export", demos


def run_case(out: Path, *, init: Path, demos: Path, is_async: bool, straggler: float, args) -> dict:
    evaluate = args.eval_episodes > 0
    overrides = [f"job.runs_root={out}", f"model.init_weights={init}", f"data.root={demos}",
                 f"rl.async={str(is_async).lower()}", f"rl.straggler_delay_s={straggler}",
                 f"rl.iterations={args.iterations}", f"rl.env_workers={args.env_workers}",
                 f"eval.enabled={str(evaluate).lower()}"]
    if evaluate:
        overrides += [f"eval.episodes_per_task={args.eval_episodes}", "eval.reference_policies=[]"]
    started = time.perf_counter()
    run_dir = run_dir_of(cli("submit", RECIPE, "--local", "--json", *overrides).stdout)
    wall_s = time.perf_counter() - started
    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    step_s = sum(m.get("time/step_s", 0.0) for m in metrics)
    env_steps = sum(m.get("rl/env_steps_per_s", 0.0) * m.get("time/step_s", 0.0) for m in metrics)
    samples = sum(m.get("rl/admitted", 0.0) for m in metrics)
    last = [m["env/success_once"] for m in metrics if "env/success_once" in m][-2:]
    row = {"async": is_async, "straggler_s": straggler, "versions": len(metrics), "wall_s": wall_s,
           "env_steps_per_s": env_steps / max(step_s, 1e-9), "samples_per_s": samples / max(step_s, 1e-9),
           "train_success": statistics.fmean(last) if last else float("nan"),
           "staleness_max": max((m.get("rl/staleness_max", 0.0) for m in metrics), default=0.0),
           "rejected_stale": sum(m.get("rl/rejected_stale", 0.0) for m in metrics), "run_dir": str(run_dir)}
    if evaluate:
        report = json.loads((run_dir / "eval" / "report.json").read_text())
        overall = report["results"]["policies"]["trained"]["overall"]
        row["eval"] = (overall["successes"], overall["recorded"], overall["ci_low"], overall["ci_high"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init-weights", type=Path, help="an SFT export folder (default: build one)")
    parser.add_argument("--data", type=Path, help="the demonstrations it was trained on (with --init-weights)")
    parser.add_argument("--iterations", type=int, default=6, help="policy versions per case")
    parser.add_argument("--env-workers", type=int, default=2)
    parser.add_argument("--straggler-delay", type=float, default=0.02, help="seconds per env step of worker 0")
    parser.add_argument("--eval-episodes", type=int, default=0, help="held-out evaluation of each final policy")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    if (args.init_weights is None) != (args.data is None):
        parser.error("--init-weights and --data go together")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rl-async-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.init_weights is None:
        print("building the SFT policy (20 reach-v3 demonstrations, 150 steps) ...", flush=True)
        init, demos = build_sft(work / "sft")
    else:
        init, demos = args.init_weights, args.data
    rows = []
    for straggler in (0.0, args.straggler_delay):  # interleaved: sync, async for each setting
        for is_async in (False, True):
            row = run_case(work / "runs", init=init, demos=demos, is_async=is_async, straggler=straggler,
                           args=args)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "run_dir"}), flush=True)
    print(f"\n{'case':<24} {'env steps/s':>12} {'samples/s':>10} {'wall s':>8} {'success':>8}  stale max")
    for row in rows:
        name = f"{'async' if row['async'] else 'sync'}, straggler {row['straggler_s']:g} s"
        success = (f"{row['eval'][0]}/{row['eval'][1]}" if "eval" in row else f"{row['train_success']:.2f}")
        print(f"{name:<24} {row['env_steps_per_s']:>12.1f} {row['samples_per_s']:>10.1f} {row['wall_s']:>8.0f} "
              f"{success:>8}  {row['staleness_max']:.0f}")
    print()
    for straggler in (0.0, args.straggler_delay):
        sync, asy = (next(r for r in rows if r["straggler_s"] == straggler and r["async"] is a) for a in (False, True))
        goal = GOALS[straggler > 0]
        for key in ("env_steps_per_s", "samples_per_s"):
            ratio = asy[key] / max(sync[key], 1e-9)
            print(f"{'with' if straggler else 'without'} straggler: async/sync {key} {ratio:.2f}x "
                  f"(goal >= {goal}x: {'ok' if ratio >= goal else 'BELOW'})")
    print(f"runs: {work}")


if __name__ == "__main__":
    main()
