"""A shard's episodes N at a time: each env steps in its own worker process, the policy acts on all of them at once.

    from embodyhpc.eval.vector import PerEnvPolicies, SuiteSpec, run_shard_vector
    spec = SuiteSpec.of("libero", ["libero_spatial"], cameras=("image", "image2"), image_size=256)
    summary = run_shard_vector(spec, shard_episodes, trained_policy, out, policy_name="trained", num_envs=8,
                               video_dir=run_dir / "eval/videos")
    summary = run_shard_vector(spec, shard_episodes, PerEnvPolicies(lambda: RandomPolicy(suite), 8), ...)

Why: a MuJoCo env steps on one thread and LIBERO renders on the CPU or the GPU, so a shard with a GPU policy and N
cores runs N envs in parallel processes; the policy predicts the chunks of every env that needs one in a single
batch per receding-horizon step (Pi05Runner.act_batch), which is what keeps the GPU busy.

Workers (multiprocessing "spawn": the parent may hold CUDA and GL state that must not be forked) build their own
suite from a picklable SuiteSpec and their own env from the episode triple (task, seed, episode), which is a pure
function of its arguments (embodyhpc.eval.suites), so nothing unpicklable crosses the pipe and an episode gives the
same record as in `run_shard`'s sequential loop. Pipe protocol (parent -> worker, each answered by ("ok", value)
or ("error", message)):

    ("start", task, seed, episode, video)  -> (observation, the suite's step limit of task)
    ("step", action, observe)              -> (observation, reward, success, done)   observe: env.observe_images
    ("finish",)                            -> None: the video is closed, the env handed back to the suite
    ("close",)                             -> the worker closes its suite and exits

Records, videos and the shard file are those of `embodyhpc.eval.rollout.run_shard` (same fields, same video names,
the file written atomically in plan order); wall_s of a record is the episode's time in this shard, with its
neighbours running alongside.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from embodyhpc.atomic import write_jsonl_atomic
from embodyhpc.eval.policies import Policy
from embodyhpc.eval.rollout import (
    EpisodeVideo,
    ShardSummary,
    VideoKeeper,
    check_shard_args,
    episode_record,
    shard_order,
    shard_record,
)
from embodyhpc.eval.shards import Episode
from embodyhpc.eval.suites import Obs, Suite, episode_seed, suite_factory

WORKER_CLOSE_TIMEOUT_S = 30.0
WORKER_THREAD_VARS = ("LP_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
"""Thread counts a worker sets to 1 where unset: Mesa's llvmpipe (CPU rendering) and BLAS would otherwise start
a thread per core in every worker."""


@dataclass(frozen=True)
class SuiteSpec:
    """What a worker needs to build the suite itself: its factory (a class or module-level function, pickled by
    name) and arguments, as `make_suite(name, tasks, cameras=..., image_size=..., **options)` would call it."""

    name: str
    factory: Callable[..., Suite]
    tasks: tuple[str, ...]
    cameras: tuple[str, ...] = ()
    image_size: int = 64
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, tasks: Sequence[str], *, cameras: Sequence[str] = (), image_size: int = 64,
           **options: Any) -> SuiteSpec:
        return cls(name, suite_factory(name), tuple(tasks), tuple(cameras), image_size, dict(options))

    def make(self) -> Suite:
        return self.factory(list(self.tasks), cameras=self.cameras, image_size=self.image_size, **self.options)


class BatchPolicy(Protocol):
    """A policy that serves several envs: per-env episode state, one call for the actions of many envs."""

    def reset(self, task: str, seed: int, env: int) -> None: ...

    def act_batch(self, observations: Sequence[Obs], envs: Sequence[int]) -> list[np.ndarray]: ...


class PerEnvPolicies:
    """A BatchPolicy made of one independent `Policy` per env (the reference policies: nothing to batch)."""

    def __init__(self, make: Callable[[], Policy], num_envs: int) -> None:
        self.policies = [make() for _ in range(num_envs)]

    def reset(self, task: str, seed: int, env: int) -> None:
        self.policies[env].reset(task, seed)

    def act_batch(self, observations: Sequence[Obs], envs: Sequence[int]) -> list[np.ndarray]:
        return [self.policies[env].act(obs) for obs, env in zip(observations, envs, strict=True)]

    def reads_next_observation(self, env: int) -> bool:
        reads = getattr(self.policies[env], "reads_next_observation", None)
        return reads is None or bool(reads())

    def episode_info(self, env: int) -> dict[str, Any]:
        """What env's policy reports of its finished episode (the replay row's "replay" field), {} if nothing."""
        info = getattr(self.policies[env], "episode_info", None)
        return info() if info is not None else {}


def _worker(conn: Any, spec: SuiteSpec) -> None:
    """One env process: serves the pipe protocol of the module doc until ("close",) or the parent goes away."""
    for var in WORKER_THREAD_VARS:  # N workers share the shard's cores: one thread each unless the site says
        os.environ.setdefault(var, "1")
    suite = env = recorder = None
    try:
        suite = spec.make()
        while True:
            try:
                message = conn.recv()
            except EOFError:
                return
            try:
                command = message[0]
                if command == "close":
                    return
                if command == "start":
                    _, task, seed, episode, video = message
                    env = suite.make_env(task, seed, episode)
                    recorder = EpisodeVideo(video, env.fps) if video is not None else None
                    obs = env.reset()
                    if recorder:
                        recorder.write(env.render())
                    reply: Any = (obs, suite.max_steps(task))
                elif command == "step":
                    _, action, observe = message
                    if observe is not None and hasattr(env, "observe_images"):
                        env.observe_images(observe)
                    reply = env.step(action)
                    if recorder:
                        recorder.write(env.render())
                elif command == "finish":
                    if recorder:
                        recorder.close()
                    recorder = None
                    env.close()
                    env = reply = None
                else:
                    raise ValueError(f"unknown command {command!r}")
                conn.send(("ok", reply))
            except Exception as exc:
                conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if recorder:
            recorder.abort()
        if env is not None:
            env.close()
        if suite is not None:
            suite.close()
        conn.close()


class EnvWorkers:
    """`num_envs` worker processes, each building `spec`'s suite; a context manager that always reaps them."""

    def __init__(self, spec: SuiteSpec, num_envs: int) -> None:
        if num_envs < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        context = multiprocessing.get_context("spawn")
        self._conns, self._procs = [], []
        for _ in range(num_envs):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(child, spec), daemon=True,
                                   name=f"embodyhpc-env-{len(self._procs)}")
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self.doing: list[str] = ["starting"] * num_envs
        """What each env was last asked to do, for error messages."""

    def __len__(self) -> int:
        return len(self._conns)

    def send(self, env: int, *message: Any, doing: str) -> None:
        self.doing[env] = doing
        self._conns[env].send(message)

    def recv(self, env: int) -> Any:
        try:
            status, value = self._conns[env].recv()
        except (EOFError, ConnectionError) as exc:
            code = self._procs[env].exitcode
            raise RuntimeError(f"env worker {env} died while {self.doing[env]} (exit code {code})") from exc
        if status != "ok":
            first, _, trace = str(value).partition("\n")
            raise RuntimeError(f"env worker {env} failed while {self.doing[env]}: {first}\n{trace}".rstrip())
        return value

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("close",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + WORKER_CLOSE_TIMEOUT_S
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> EnvWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Running:
    """An episode in flight on one env."""

    index: int  # in plan order
    episode: Episode
    video: Path | None
    start: float
    obs: Obs = field(default_factory=dict)
    limit: int = 0
    total: float = 0.0
    length: int = 0
    success_step: int | None = None


def run_shard_vector(spec: SuiteSpec, episodes: Sequence[Episode], policy: BatchPolicy, out_jsonl: str | os.PathLike,
                     *, policy_name: str, num_envs: int, video_dir: str | os.PathLike | None = None,
                     videos_per_task: int = 1, max_steps: int | None = None, stop_on_success: bool = True,
                     extra: Mapping[str, Any] | None = None) -> ShardSummary:
    """`run_shard` with `num_envs` episodes at a time (see the module doc); the same records in the same file."""
    check_shard_args(videos_per_task, extra)
    out = Path(out_jsonl)
    out.parent.mkdir(parents=True, exist_ok=True)
    ordered = shard_order(episodes)
    pending = deque(enumerate(ordered))
    records: dict[int, dict[str, Any]] = {}
    summary = ShardSummary(out=out, policy=policy_name)
    reads = getattr(policy, "reads_next_observation", None)
    info = getattr(policy, "episode_info", None)
    videos = VideoKeeper(video_dir, policy_name, videos_per_task)
    start = time.perf_counter()
    with EnvWorkers(spec, min(num_envs, max(len(ordered), 1))) as workers:
        summary.num_envs = len(workers)
        running: dict[int, _Running] = {}

        def start_next(envs: Sequence[int]) -> None:
            started = []
            for env in envs:
                if not pending:
                    continue
                index, episode = pending.popleft()
                video = videos.film(episode)
                policy.reset(episode.task, episode_seed(episode.task, episode.seed, episode.episode), env)
                running[env] = _Running(index, episode, video, time.perf_counter())
                workers.send(env, "start", episode.task, episode.seed, episode.episode, video,
                             doing=f"starting {episode}")
                started.append(env)
            for env in started:
                running[env].obs, suite_limit = workers.recv(env)
                running[env].limit = max_steps or suite_limit
                if running[env].limit < 1:
                    raise ValueError(f"max_steps must be >= 1, got {running[env].limit}")

        start_next(range(len(workers)))
        while running:
            envs = sorted(running)
            actions = policy.act_batch([running[env].obs for env in envs], envs)
            for env, action in zip(envs, actions, strict=True):
                observe = bool(reads(env)) if reads is not None else None
                workers.send(env, "step", np.asarray(action, dtype=np.float32), observe,
                             doing=f"stepping {running[env].episode}")
            finished = []
            for env in envs:
                now = running[env]
                now.obs, reward, success, done = workers.recv(env)
                now.length += 1
                now.total += reward
                if success and now.success_step is None:
                    now.success_step = now.length
                if done or (success and stop_on_success) or now.length >= now.limit:
                    finished.append(env)
            for env in finished:
                workers.send(env, "finish", doing=f"finishing {running[env].episode}")
            for env in finished:
                workers.recv(env)
                done_episode = running.pop(env)
                kept = videos.keep(done_episode.episode, done_episode.video, done_episode.success_step is not None)
                records[done_episode.index] = _record(done_episode, policy_name, kept, extra)
                if info is not None and (reported := info(env)):  # as rollout.run_episode does for one env
                    records[done_episode.index]["replay"] = reported
                summary.episodes += 1
                summary.successes += int(done_episode.success_step is not None)
                summary.steps += done_episode.length
                if kept:
                    summary.videos.append(Path(video_dir) / kept)
            start_next(finished)
    write_jsonl_atomic(out, [records[index] for index in sorted(records)], durable=True)
    summary.wall_s = time.perf_counter() - start
    return summary


def _record(done: _Running, policy_name: str, video: str | None, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    record = episode_record(done.episode, total=done.total, length=done.length, success_step=done.success_step,
                            start=done.start)
    return shard_record(policy_name, done.episode, record, video=video, extra=extra)


__all__ = ["BatchPolicy", "EnvWorkers", "PerEnvPolicies", "SuiteSpec", "run_shard_vector"]
