"""Batched evaluation shards: episodes per shard-minute with N envs at once (embodyhpc.eval.vector) vs one at a time.

Cases, on the same episodes (MetaWorld, one 32 px camera, the tiny pi0.5 with random weights, so every episode runs
to --max-steps), interleaved over --repeats rounds, medians reported:
  1 env     embodyhpc.eval.rollout.run_shard: today's shard (eval.envs_per_shard: 1), the policy in this process
  N envs    run_shard_vector: N worker processes step their envs, the policy acts on all N per step (act_batch)
Rates are wall-clock episodes per minute of the whole shard call (worker start-up included: a shard pays it).
The policy's share is its time in act / act_batch over the shard's wall time: what a GPU would shrink, and what
batching spreads over N envs. Torch runs on one thread; workers step MuJoCo on one thread each, so N envs want
N + 1 cores: on a 2-core machine expect little, on a node's 8-16 cores up to ~N x for env-bound shards.

    .venv/bin/python bench/eval_vector.py [--envs 4] [--episodes 8] [--max-steps 60] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ["LP_NUM_THREADS"] = "1"  # one llvmpipe render thread per process
for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[var] = "1"

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from embodyhpc.data.normalize import StateNormalizer  # noqa: E402
from embodyhpc.eval.rollout import run_shard  # noqa: E402
from embodyhpc.eval.shards import Episode  # noqa: E402
from embodyhpc.eval.vector import SuiteSpec, run_shard_vector  # noqa: E402
from embodyhpc.models import build_model  # noqa: E402
from embodyhpc.models.pi05.inference import Pi05Runner  # noqa: E402
from embodyhpc.validation import load_recipe  # noqa: E402


class Timed:
    """The policy with the time spent in act / act_batch counted (reset and queue checks are negligible)."""

    def __init__(self, policy: Pi05Runner) -> None:
        self.policy, self.policy_s = policy, 0.0

    def reset(self, task, seed, env=0):
        self.policy.reset(task, seed, env)

    def act(self, obs):
        start = time.perf_counter()
        try:
            return self.policy.act(obs)
        finally:
            self.policy_s += time.perf_counter() - start

    def act_batch(self, observations, envs):
        start = time.perf_counter()
        try:
            return self.policy.act_batch(observations, envs)
        finally:
            self.policy_s += time.perf_counter() - start

    def reads_next_observation(self, env=0):
        return self.policy.reads_next_observation(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--envs", type=int, default=max(2, min(4, os.cpu_count() or 2)))
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tasks", nargs="+", default=["reach-v3", "drawer-open-v3"])
    args = parser.parse_args()
    torch.set_num_threads(1)

    config = load_recipe("demo_metaworld_cpu").config
    torch.manual_seed(0)
    model = build_model(config.model, config.precision).float()

    def policy() -> Timed:
        return Timed(Pi05Runner(model, config, normalizer=StateNormalizer(config.model.state_key, "none"),
                                   execute_steps=5, denoise_steps=4, num_action_dims=4))

    spec = SuiteSpec.of("metaworld", args.tasks, cameras=["corner"], image_size=32)
    per_task = -(-args.episodes // len(args.tasks))
    episodes = [Episode(task, 100, e) for task in args.tasks for e in range(per_task)][: args.episodes]
    results: dict[str, list[tuple[float, float, float]]] = {"1 env": [], f"{args.envs} envs": []}
    print(f"eval_vector: {len(episodes)} episodes x {args.max_steps} steps, tiny pi0.5 (execute 5 of 10, 4 denoising "
          f"steps), {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for name in results:
                timed = policy()
                out = Path(tmp) / f"{repeat}-{name.replace(' ', '')}.jsonl"
                start = time.perf_counter()
                if name == "1 env":
                    with spec.make() as suite:
                        summary = run_shard(suite, episodes, timed, out, policy_name="trained",
                                            max_steps=args.max_steps)
                else:
                    summary = run_shard_vector(spec, episodes, timed, out, policy_name="trained",
                                               num_envs=args.envs, max_steps=args.max_steps)
                wall_s = time.perf_counter() - start
                batch = timed.policy.chunks_predicted / max(timed.policy.batches_predicted, 1)
                results[name].append((summary.episodes / wall_s * 60, timed.policy_s / wall_s, batch))
    base = statistics.median(r[0] for r in results["1 env"])
    print(f"{'case':>8} {'episodes/shard-min':>19} {'vs 1 env':>9} {'policy share':>13} {'chunks/forward':>15}")
    for name, rows in results.items():
        rate = statistics.median(r[0] for r in rows)
        share = statistics.median(r[1] for r in rows)
        batch = statistics.median(r[2] for r in rows)
        print(f"{name:>8} {rate:19.1f} {rate / base:8.2f}x {share:12.0%} {batch:15.2f}")


if __name__ == "__main__":
    main()
