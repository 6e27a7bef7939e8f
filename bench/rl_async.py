"""RL pipeline throughput: the asynchronous pipeline (rl.async: true, RL-VLA3's three levels) against the synchronous
one (rl.async: false), on the same processes and cores, with and without a deliberately slow env worker.

    python bench/rl_async.py                                    # builds a few-shot SFT policy first (~1 min)
    python bench/rl_async.py --init-weights RUN/export --data DEMOS   # an SFT export and its demonstrations
    python bench/rl_async.py --iterations 8 --straggler-delay 0.02 --env-workers 2 --eval-episodes 24
    python bench/rl_async.py --init-weights RUN/export --data DEMOS --repeats 3 --seed 1 --settings no-straggler

Each case is `embodyhpc submit recipes/rl_metaworld_cpu.yaml --local` (the three roles as local processes: actor,
rollout worker, env workers) from the same SFT export, for the same number of policy versions; the cases run one
after the other, interleaved (sync, async, sync, async with --repeats), each with `uptime` before and after. Read
from the run's logs/metrics.jsonl (one line per version), leaving out version 1 (it also pays the roles' start):
env steps/s = the environment steps over the summed step time; actor samples/s = the chunk samples the actor
admitted (staleness gate passed) over the same time (trained/s: those that carried a gradient); the share of the
step time each role reports (env, rollout inference, actor compute, weight sync, the rollouts' wait on the
actor's full queue). The straggler: env worker 0 sleeps --straggler-delay seconds per environment step
(rl.straggler_delay_s), so the synchronous rounds wait for it while the asynchronous pipeline keeps the other env
worker's envs and the actor busy. "Final success": the episodes of the last FINAL_VERSIONS versions (env/success_once
x env/episodes, training seeds) with a 95% Wilson interval per arm, the same number of versions each, and the
asynchronous versions sized like the synchronous rounds (--async-batch: train.global_batch_size 256 chunk samples,
at least: a step ends with the group that reached it; a round of 32 episodes trains about 250-350; the recipe's 128
would make async versions about half as large, and success per version incomparable). Those training episodes lag
behind in the asynchronous arm by design (they were played by versions up to rl.max_staleness older, with Flow-SDE
noise), so equal final success is judged on the final policies: the held-out evaluation of each (--eval-episodes,
default 48; eval.seeds [100]: the same goals, episodes and number of versions per arm), equal when the 95% Wilson
intervals of the successes pooled over the pairs overlap (pair i runs train.seed --seed + i in both arms: the
rollouts' noise, and with it how soon a few versions take off, differs from seed to seed in either arm: held-out 48,
19, 30 of 48 for sync and 45, 0, 47 for async over seeds 1-3 on 2026-11-27, so one pair judges nothing);
--eval-episodes 0 skips it and falls back on the training episodes. --per-version prints each run's versions:
samples admitted / rejected as stale, staleness mean / max, the importance weights and their capped share, the
success of the episodes that ended. --max-staleness sets rl.max_staleness in both arms (the synchronous
one never has a stale sample).

Goal (issue 31): async >= 1.5x sync with a straggler and >= 1.2x without, at equal final success. On 2 cores the
roles (2 env workers, 1 rollout worker, 1 actor rank) share the cores, so overlap can only hide waiting, not add
compute: what async wins here is the time the synchronous rounds spend waiting for the slowest env and for the
actor's step. The bench reports; it always exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from embodyhpc.eval.aggregate import wilson_interval

REPO = Path(__file__).resolve().parents[1]
RECIPE = "recipes/rl_metaworld_cpu.yaml"
GOALS = {True: 1.5, False: 1.2}  # with a straggler, without
CORES = len(os.sched_getaffinity(0))
WARMUP_VERSIONS = 1  # left out of the rates: the first version also pays the roles' start
FINAL_VERSIONS = 2  # "final success": the episodes of the last versions, with their Wilson interval


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
    """The few-shot SFT policy tests/rl/test_rl_closed_loop.py starts from (embodyhpc.rl.few_shot): its export
    folder and the demonstrations."""
    from embodyhpc.rl.few_shot import build_few_shot_sft

    return build_few_shot_sft(out, lambda *a: cli(*a).stdout)


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every process this one has waited for, their own waited-for children included:
    the submit command and all the roles it ran."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def run_case(out: Path, *, init: Path, demos: Path, is_async: bool, straggler: float, seed: int, args) -> dict:
    evaluate = args.eval_episodes > 0
    overrides = [f"job.runs_root={out}", f"model.init_weights={init}", f"data.root={demos}", f"train.seed={seed}",
                 f"rl.async={str(is_async).lower()}", f"rl.straggler_delay_s={straggler}",
                 f"rl.iterations={args.iterations}", f"rl.env_workers={args.env_workers}",
                 f"eval.enabled={str(evaluate).lower()}"]
    if args.max_staleness is not None:
        overrides.append(f"rl.max_staleness={args.max_staleness}")
    if is_async:  # steps of about a synchronous round's chunk samples: versions of the two arms compare
        overrides.append(f"train.global_batch_size={args.async_batch}")
    if evaluate:
        overrides += [f"eval.episodes_per_task={args.eval_episodes}", "eval.reference_policies=[]"]
    load_before = uptime()
    cpu_before = children_cpu_s()
    started = time.perf_counter()
    run_dir = run_dir_of(cli("submit", RECIPE, "--local", "--json", *overrides).stdout)
    wall_s = time.perf_counter() - started
    cpu_s = children_cpu_s() - cpu_before
    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steady = metrics[WARMUP_VERSIONS:] or metrics  # version 1 also pays the start (processes, first weights)
    step_s = sum(m.get("time/step_s", 0.0) for m in steady)
    env_steps = sum(m.get("rl/env_steps_per_s", 0.0) * m.get("time/step_s", 0.0) for m in steady)
    admitted = sum(m.get("rl/admitted", 0.0) for m in steady)
    trained = sum(m.get("rl/samples", 0.0) for m in steady)
    last = [m for m in metrics if m.get("env/episodes")][-FINAL_VERSIONS:]
    episodes = int(sum(m["env/episodes"] for m in last))
    successes = int(round(sum(m.get("env/success_once", 0.0) * m["env/episodes"] for m in last)))
    roles = {key: sum(m.get(f"time/{key}", 0.0) for m in steady) / max(step_s, 1e-9)
             for key in ("env_s", "rollout_s", "actor_s", "sync_s", "push_wait_s")}
    row = {"async": is_async, "straggler_s": straggler, "seed": seed, "versions": len(metrics), "wall_s": wall_s,
           "env_steps_per_s": env_steps / max(step_s, 1e-9), "samples_per_s": admitted / max(step_s, 1e-9),
           "trained_per_s": trained / max(step_s, 1e-9),
           "final": (successes, episodes, *wilson_interval(successes, episodes)),
           "role_share": {k: round(v, 2) for k, v in roles.items()},
           "staleness_max": max((m.get("rl/staleness_max", 0.0) for m in metrics), default=0.0),
           "rejected_stale": sum(m.get("rl/rejected_stale", 0.0) for m in metrics), "run_dir": str(run_dir),
           "cpu_s": cpu_s, "cores_busy": cpu_s / max(wall_s, 1e-9) / CORES,
           "cpu_ms_per_env_step": 1000 * cpu_s / max(sum(m.get("rl/env_steps_per_s", 0.0) * m.get("time/step_s", 0.0)
                                                         for m in metrics), 1e-9),
           "uptime_before": load_before, "uptime_after": uptime()}
    if evaluate:
        report = json.loads((run_dir / "eval" / "report.json").read_text())
        overall = report["results"]["policies"]["trained"]["overall"]
        row["eval"] = (overall["successes"], overall["recorded"], overall["ci_low"], overall["ci_high"])
    return row


def per_version(run_dir: Path) -> list[str]:
    """One line per version of a run: samples admitted / rejected as stale, staleness mean / max, the importance
    weights (GRPO: truncated IS; PPO: the behaviour weight) and their capped share, success of the episodes ended."""
    lines = []
    for line in (Path(run_dir) / "logs" / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        weight = m.get("loss/is_weight_mean", m.get("loss/behav_weight_mean", float("nan")))
        capped = m.get("loss/truncated_fraction", m.get("loss/behav_capped_fraction", float("nan")))
        success = f"{m['env/success_once']:.2f} of {m['env/episodes']:.0f}" if m.get("env/episodes") else "-"
        stale = f"{m.get('rl/staleness_mean', 0):.2f}/{m.get('rl/staleness_max', 0):.0f}"
        lines.append(f"  v{m['step']:<3} admitted {m.get('rl/admitted', 0):>4.0f} rejected "
                     f"{m.get('rl/rejected_stale', 0):>4.0f} staleness {stale} trained {m.get('rl/samples', 0):>4.0f}"
                     f" IS weight {weight:.3f} capped {capped:.3f} success {success}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init-weights", type=Path, help="an SFT export folder (default: build one)")
    parser.add_argument("--data", type=Path, help="the demonstrations it was trained on (with --init-weights)")
    parser.add_argument("--iterations", type=int, default=5, help="policy versions per case")
    parser.add_argument("--env-workers", type=int, default=2)
    parser.add_argument("--straggler-delay", type=float, default=0.02, help="seconds per env step of worker 0")
    parser.add_argument("--eval-episodes", type=int, default=48,
                        help="held-out evaluation of each final policy (0: none; equal final success is then judged "
                             "on the training episodes)")
    parser.add_argument("--max-staleness", type=int, help="rl.max_staleness in both arms (default: the recipe's)")
    parser.add_argument("--async-batch", type=int, default=256,
                        help="async: chunk samples per version (train.global_batch_size; a multiple of 64); a sync "
                             "round of 32 episodes trains about 250-350")
    parser.add_argument("--repeats", type=int, default=1, help="sync/async pairs per setting (interleaved)")
    parser.add_argument("--seed", type=int, default=0,
                        help="train.seed of the first pair (the rollouts' Flow-SDE noise, the actor's RNG); pair i "
                             "runs seed + i in both arms, so that repeats show each arm's own spread")
    parser.add_argument("--settings", choices=("both", "straggler", "no-straggler"), default="both")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a temp dir)")
    parser.add_argument("--per-version", action="store_true", help="print each run's versions (admission, "
                        "staleness, importance weights, success)")
    args = parser.parse_args()
    if (args.init_weights is None) != (args.data is None):
        parser.error("--init-weights and --data go together")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.settings != "no-straggler" and not args.straggler_delay > 0:
        parser.error(f"--straggler-delay must be above 0 with --settings {args.settings} (or use --settings "
                     f"no-straggler), got {args.straggler_delay}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rl-async-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.init_weights is None:
        print("building the few-shot SFT policy (embodyhpc.rl.few_shot: 20 reach-v3 demonstrations, 150 steps) ...",
              flush=True)
        init, demos = build_sft(work / "sft")
    else:
        init, demos = args.init_weights, args.data
    rows = []
    stragglers = {"both": (0.0, args.straggler_delay), "straggler": (args.straggler_delay,),
                  "no-straggler": (0.0,)}[args.settings]
    for straggler in stragglers:
        for pair in range(args.repeats):  # interleaved: sync, async, sync, async, ... on the same processes and cores
            for is_async in (False, True):
                row = run_case(work / "runs", init=init, demos=demos, is_async=is_async, straggler=straggler,
                               seed=args.seed + pair, args=args)
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "run_dir"}), flush=True)
                if args.per_version:
                    print("\n".join(per_version(Path(row["run_dir"]))), flush=True)
    print(f"\n{'case':<32} {'env steps/s':>11} {'samples/s':>9} {'trained/s':>9} {'wall s':>6}  "
          f"{'final success [95% Wilson]':<28} stale max  cores busy  load (1 min, before/after)")
    for row in rows:
        name = f"{'async' if row['async'] else 'sync'}, straggler {row['straggler_s']:g} s, seed {row['seed']}"
        s_, n, lo, hi = row["final"]
        final = f"{s_}/{n} [{lo:.2f}, {hi:.2f}]"
        if "eval" in row:
            final += f" held-out {row['eval'][0]}/{row['eval'][1]}"
        load = "/".join(u.split("load average:")[-1].split(",")[0].strip() for u in (row["uptime_before"],
                                                                                     row["uptime_after"]))
        print(f"{name:<32} {row['env_steps_per_s']:>11.1f} {row['samples_per_s']:>9.1f} {row['trained_per_s']:>9.1f} "
              f"{row['wall_s']:>6.0f}  {final:<28} {row['staleness_max']:>9.0f}  {row['cores_busy']:>10.2f}  {load}")
    print()
    for straggler in stragglers:
        goal = GOALS[straggler > 0]
        pick = [r for r in rows if r["straggler_s"] == straggler]
        for key in ("env_steps_per_s", "samples_per_s"):
            sync = statistics.fmean(r[key] for r in pick if not r["async"])
            asy = statistics.fmean(r[key] for r in pick if r["async"])
            ratio = asy / max(sync, 1e-9)
            print(f"{'with' if straggler else 'without'} straggler: async/sync {key} {ratio:.2f}x "
                  f"(goal >= {goal}x: {'ok' if ratio >= goal else 'BELOW'})")
        busy = {a: statistics.fmean(r["cores_busy"] for r in pick if r["async"] is a) for a in (False, True)}
        cost = {a: statistics.fmean(r["cpu_ms_per_env_step"] for r in pick if r["async"] is a) for a in (False, True)}
        print(f"{'with' if straggler else 'without'} straggler: what limits it on {CORES} cores: sync kept "
              f"{busy[False]:.0%} of them busy and async {busy[True]:.0%} (CPU seconds of the whole run, start-up "
              f"and evaluation included, over wall seconds x cores); CPU per env step sync {cost[False]:.1f} ms, "
              f"async {cost[True]:.1f} ms: with sync's work, no overlap could run faster than "
              f"{1 / max(busy[False], 1e-9):.2f}x on these cores")
        finals = {a: [r["final"] for r in pick if r["async"] is a] for a in (False, True)}
        overlap = all(fa[2] <= fs[3] and fs[2] <= fa[3] for fs in finals[False] for fa in finals[True])
        print(f"{'with' if straggler else 'without'} straggler: training episodes of the last {FINAL_VERSIONS} "
              f"versions (played by versions up to rl.max_staleness older in async) sync "
              f"{[f'{f[0]}/{f[1]}' for f in finals[False]]} vs async {[f'{f[0]}/{f[1]}' for f in finals[True]]}: "
              f"Wilson intervals {'overlap' if overlap else 'do not overlap'}")
        held = {a: [r["eval"] for r in pick if r["async"] is a and "eval" in r] for a in (False, True)}
        if held[False] and held[True]:  # the same held-out goals, episodes and number of versions per arm
            pooled = {a: (sum(e[0] for e in held[a]), sum(e[1] for e in held[a])) for a in held}
            ci = {a: wilson_interval(*pooled[a]) for a in held}
            verdict = ("DO NOT overlap: async's final success is lower" if ci[True][1] < ci[False][0] else
                       "DO NOT overlap: async's final success is higher" if ci[True][0] > ci[False][1] else
                       "overlap: equal final success")
            print(f"{'with' if straggler else 'without'} straggler: held-out success per seed, sync "
                  f"{[f'{e[0]}/{e[1]}' for e in held[False]]} vs async {[f'{e[0]}/{e[1]}' for e in held[True]]}; "
                  f"pooled over the seeds sync {pooled[False][0]}/{pooled[False][1]} [{ci[False][0]:.2f}, "
                  f"{ci[False][1]:.2f}] vs async {pooled[True][0]}/{pooled[True][1]} [{ci[True][0]:.2f}, "
                  f"{ci[True][1]:.2f}]: Wilson intervals {verdict}")
    print(f"uptime at the end: {uptime()}")
    print(f"runs: {work}")


if __name__ == "__main__":
    main()
