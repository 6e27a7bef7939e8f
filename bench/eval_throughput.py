"""Evaluation throughput on one core: `run_shard` vs plain sequential gymnasium-style loops (MetaWorld).

Cases (each on the same episodes, interleaved over --repeats rounds, medians reported):
  shard       embodyhpc.eval.rollout.run_shard (JSONL written, the suite reuses a task's simulator)
  plain-new   for each episode: build the env (and camera renderers), reset, step until success or 500 steps
  plain-reuse one env built once, `set_task` per episode: the fastest loop one can write by hand

Policies: the scripted expert (short episodes: per-episode overhead dominates) and random (500-step episodes:
stepping dominates); optionally with a camera in every observation. The process is pinned to one core and
llvmpipe to one thread; rates are per CPU second of the process (process_time), i.e. episodes/s per core,
which other jobs on shared cores disturb much less than wall time (printed too). Goal: run_shard >= 90 % of
plain-reuse.

    .venv/bin/python bench/eval_throughput.py [--episodes 20] [--repeats 3] [--cameras corner] [--task reach-v3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ["LP_NUM_THREADS"] = "1"  # one llvmpipe render thread: one core
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = "1"

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embodyhpc.eval.policies import ExpertPolicy, RandomPolicy  # noqa: E402
from embodyhpc.eval.rollout import run_shard  # noqa: E402
from embodyhpc.eval.shards import all_episodes  # noqa: E402
from embodyhpc.eval.suites import episode_seed, make_suite  # noqa: E402
from embodyhpc.sim import metaworld as mw  # noqa: E402


def plain_loop(task, episodes, policy_kind, cameras, size, reuse):
    """Returns (episodes, steps); the loop a user would write around gymnasium's API."""
    env = renderers = None
    steps = 0
    expert = mw.make_expert(task)
    for ep in episodes:
        spec = mw.episode_spec(task, ep.seed, ep.episode)
        if env is None or not reuse:
            if env is not None:
                for r in renderers:
                    r.close()
                env.close()
            env = mw.make_env(spec.env_name, spec.env_seed, spec.env_variant)
            renderers = [mw.CameraRenderer(env.model, c, size, size) for c in cameras]
        else:
            env.set_task(mw.goal_variant(spec.env_name, spec.env_seed, spec.env_variant))
        rng = np.random.default_rng(episode_seed(task, ep.seed, ep.episode))
        obs, _ = env.reset()
        for _ in range(env.max_path_length):
            _images = [r.render(env.data) for r in renderers]
            if policy_kind == "expert":
                action = np.clip(expert.get_action(obs.copy()), -1, 1)
            else:
                action = rng.uniform(-1, 1, 4)
            obs, _, _, truncated, info = env.step(action)
            steps += 1
            if info["success"] or truncated:
                break
    for r in renderers:
        r.close()
    env.close()
    return len(episodes), steps


def shard_case(task, episodes, policy_kind, cameras, size, out):
    with make_suite("metaworld", [task], cameras=cameras, image_size=size) as suite:
        policy = ExpertPolicy(suite) if policy_kind == "expert" else RandomPolicy(suite)
        summary = run_shard(suite, episodes, policy, out, policy_name=policy_kind)
    return summary.episodes, summary.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="reach-v3")
    parser.add_argument("--episodes", type=int, default=20, help="expert episodes per case (random: a quarter)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cameras", nargs="*", default=[], help="cameras in every observation (e.g. corner)")
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    mw.goal_variant(args.task, 100, 0)  # build MT1 once (cached): every case pays it alike otherwise
    tmp = Path(tempfile.mkdtemp(prefix="eval-bench-"))
    print(f"task {args.task}, cameras {args.cameras or 'none'} at {args.size} px, 1 core, "
          f"medians of {args.repeats} interleaved rounds")
    for policy_kind, n in (("expert", args.episodes), ("random", max(1, args.episodes // 4))):
        episodes = all_episodes([args.task], [100], n)
        common = (args.task, episodes, policy_kind, args.cameras, args.size)
        cases = {
            "shard": functools.partial(shard_case, *common, tmp / "s.jsonl"),
            "plain-new": functools.partial(plain_loop, *common, False),
            "plain-reuse": functools.partial(plain_loop, *common, True),
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        walls: dict[str, list[float]] = {name: [] for name in cases}
        counts = {}
        for _ in range(args.repeats):
            for name, case in cases.items():
                start, start_wall = time.process_time(), time.perf_counter()
                counts[name] = case()
                times[name].append(time.process_time() - start)
                walls[name].append(time.perf_counter() - start_wall)
        rates = {name: counts[name][0] / statistics.median(t) for name, t in times.items()}
        for name in cases:
            n_eps, n_steps = counts[name]
            median = statistics.median(times[name])
            print(f"  {policy_kind:6s} {name:11s} {n_eps:3d} episodes {n_steps:6d} steps  {median:6.2f} CPU s "
                  f"({statistics.median(walls[name]):6.2f} wall s)  {rates[name]:6.2f} episodes/s/core  "
                  f"{n_steps / median:7.0f} steps/s/core")
        ratio = rates["shard"] / rates["plain-reuse"]
        print(f"  {policy_kind:6s} run_shard / plain-new {rates['shard'] / rates['plain-new']:.2f}x, "
              f"/ plain-reuse {ratio:.2f}x ({'ok' if ratio >= 0.9 else 'BELOW'} goal >= 0.90)")


if __name__ == "__main__":
    main()
