"""The env role: worker processes that step the simulators and talk to one rollout worker each (no torch here).

    supervise_env_role(job, worker_rank)      # the env role's process: runs its worker in a child, restarts it

Episodes are assigned deterministically (`EpisodePlan`): episode e belongs to GRPO group e // rl.group_size, whose
initial state (task, seed, episode) all the group's rollouts share; env slot s (worker w's env j is slot
w * rl.envs_per_worker + j, of N slots in all) runs the episodes e = s, s + N, s + 2N, ... The synchronous pipeline
cuts them in rounds of rl.episodes_per_iteration (round r: episodes r * E .. (r + 1) * E - 1); a slot that finished
its episodes of a round asks its rollout worker for the next one (`hello`) and waits for the reply, which comes
once the actor's new weights are in. The asynchronous pipeline has no rounds: a slot goes on with its next episode
at once.

Level 1 of RL-VLA3: each env sends its observation the moment its chunk is executed and never waits for the other
envs of its worker: replies are taken in whatever order they come. rl.straggler_delay_s makes env worker 0 sleep
that long per environment step (the benchmark's straggler).

A dead env worker: its supervisor (the env role's process) restarts it, at most MAX_RESTARTS times, then fails
the job naming the worker and its exit code. A hung one (stopped, or stuck in its simulator) is one whose heartbeat
(a shared timestamp the worker stamps at every step of its loop and at every message from its rollout worker,
heartbeats included) is older than rl.peer_timeout_s + HANG_GRACE_S: every wait of a live worker is bounded by
rl.peer_timeout_s, so nothing else makes it that old. Its supervisor kills it and restarts it like a dead one.
Episodes in flight when it died are re-run from their initial state by the restarted worker (the slots' current
episodes are kept in shared memory): their groups stay whole, and the actor drops the dead attempt's pieces when
the same episode starts again (chunk 0).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from embodyhpc.errors import RunFailure
from embodyhpc.rl.codec import Codec, Message, action_from, episode_end_message, observation_message
from embodyhpc.rl.samples import EpisodeEnd
from embodyhpc.rl.transport import PeerTimeout, Requester

MAX_RESTARTS = 3
NOT_STARTED = -1
HANG_GRACE_S = 30.0  # beyond rl.peer_timeout_s: an env reset or a chunk of steps never takes that long
WATCH_S = 0.5  # how often the supervisor looks at its worker
KILL_WAIT_S = 10.0  # a killed worker is gone within this (SIGKILL also ends a stopped process)


@dataclass(frozen=True)
class EpisodePlan:
    """Which episode each env slot runs and which initial state each episode starts from (module docstring)."""

    tasks: tuple[str, ...]
    train_seeds: tuple[int, ...]
    group_size: int
    num_slots: int
    episodes_per_round: int

    def group_of(self, episode: int) -> int:
        return episode // self.group_size

    def initial_state(self, episode: int) -> tuple[str, int, int]:
        """(task, seed, simulator episode index) of `episode`: the same for every rollout of its group."""
        group = self.group_of(episode)
        task = self.tasks[group % len(self.tasks)]
        rest = group // len(self.tasks)
        return task, self.train_seeds[rest % len(self.train_seeds)], rest // len(self.train_seeds)

    def first_episode(self, slot: int, round_: int) -> int:
        """The slot's first episode at or after the start of `round_`."""
        start = round_ * self.episodes_per_round
        return start + (slot - start) % self.num_slots

    def round_of(self, episode: int) -> int:
        return episode // self.episodes_per_round

    def episodes_in_round(self, slots: Any, round_: int) -> int:
        """How many episodes of `round_` the given slots run."""
        start, end = round_ * self.episodes_per_round, (round_ + 1) * self.episodes_per_round
        return sum(len(range(self.first_episode(s, round_), end, self.num_slots)) for s in slots
                   if self.first_episode(s, round_) < end and start <= self.first_episode(s, round_))


@dataclass(frozen=True)
class EnvJob:
    """What an env worker needs, all picklable (a restarted worker is a fresh spawned process)."""

    suite: str
    tasks: tuple[str, ...]
    cameras: tuple[str, ...]
    image_size: int
    suite_options: dict
    plan: EpisodePlan
    sync: bool
    envs_per_worker: int
    execute_steps: int
    max_episode_steps: int
    straggler_delay_s: float
    rollout_address: str
    rollout_name: str
    key: bytes
    timeout_s: float


class _Slot:
    """One env of the worker and its episode in progress."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.env: Any = None
        self.episode = NOT_STARTED
        self.chunk = 0
        self.steps = 0
        self.ret = 0.0
        self.success = False
        self.env_s = 0.0
        self.resume = NOT_STARTED
        self.bounds: Any = None
        self.last_obs: Any = None


def run_env_worker(job: EnvJob, worker_rank: int, attempt: int = 0, progress: Any = None,
                   make_suite: Callable[..., Any] | None = None, alive: Any = None) -> int:
    """Step this worker's envs until the rollout worker says stop; returns the episodes finished. `progress`: a
    shared array of each slot's current episode (the supervisor's, for a restart), or None. `alive`: a shared
    double the worker stamps with time.monotonic() as it goes (its heartbeat for the supervisor), or None."""
    if make_suite is None:
        make_suite = suite_maker(job.suite)

    def beat() -> None:
        if alive is not None:
            alive.value = time.monotonic()

    codec = Codec(job.key, sender=f"env-{worker_rank}.{attempt}")
    req = Requester(job.rollout_address, codec, peer=job.rollout_name, timeout_s=job.timeout_s, on_receive=beat)
    slots = [_Slot(worker_rank * job.envs_per_worker + j) for j in range(job.envs_per_worker)]
    by_id = {s.slot: s for s in slots}
    delay = job.straggler_delay_s if worker_rank == 0 else 0.0
    finished = 0
    options = {"max_idle": job.envs_per_worker, **job.suite_options} if job.suite == "metaworld" \
        else job.suite_options
    suite = make_suite(job.suite, list(job.tasks), cameras=job.cameras, image_size=job.image_size, **options)
    try:
        for s in slots:  # every slot asks where to start (a restarted one re-runs its episode in flight)
            s.resume = NOT_STARTED if progress is None else int(progress[s.slot % len(progress)])
            req.send(Message("hello", {"env_id": s.slot, "worker": worker_rank, "resume": s.resume}))
        live = len(slots)
        while live:
            beat()
            reply = req.recv()
            if reply.kind == "stop":
                break
            if reply.kind == "hello":  # where to start, or the next round
                s = by_id[int(reply.fields["env_id"])]
                episode = s.resume if s.resume >= 0 else job.plan.first_episode(s.slot, int(reply.fields["round"]))
                s.resume = NOT_STARTED
                _start(job, suite, s, episode, req, worker_rank, progress)
                continue
            env_id, actions, version = action_from(reply)
            s = by_id[env_id]
            done = _execute(job, s, actions, delay)
            if not done:
                s.chunk += 1
                _send_observation(job, s, req, worker_rank, s.last_obs)
                continue
            finished += 1
            end = EpisodeEnd(env_id=s.slot, episode_id=s.episode, group_id=job.plan.group_of(s.episode),
                             success=s.success, episode_return=s.ret, length=s.steps, version=version)
            message = episode_end_message(end)
            message.fields.update(env_s=s.env_s, worker=worker_rank)
            req.send(message)
            nxt = s.episode + job.plan.num_slots
            if job.sync and job.plan.round_of(nxt) != job.plan.round_of(s.episode):
                s.env.close()
                s.env = None
                if progress is not None:
                    progress[s.slot % len(progress)] = NOT_STARTED
                req.send(Message("hello", {"env_id": s.slot, "worker": worker_rank, "round": job.plan.round_of(nxt),
                                           "resume": NOT_STARTED}))
            else:
                _start(job, suite, s, nxt, req, worker_rank, progress)
    finally:
        for s in slots:
            if s.env is not None:
                s.env.close()
        suite.close()
        req.close()
    return finished


def suite_maker(name: str) -> Callable[..., Any]:
    """make_suite for a registered suite name; a "module:attr" factory (a site's or a test's suite in a spawned
    worker, where a register_suite call of the parent does not exist) is imported and called the same way."""
    if ":" not in name:
        from embodyhpc.eval.suites import make_suite

        return make_suite
    import importlib

    module, _, attr = name.partition(":")
    factory = getattr(importlib.import_module(module), attr)
    return lambda _name, tasks, **kwargs: factory(tasks, **kwargs)


def _start(job: EnvJob, suite: Any, s: _Slot, episode: int, req: Requester, worker_rank: int, progress: Any) -> None:
    if s.env is not None:
        s.env.close()
    task, seed, sim_episode = job.plan.initial_state(episode)
    s.env = suite.make_env(task, seed, sim_episode)
    s.bounds = suite.action_bounds(task)
    s.episode, s.chunk, s.steps, s.ret, s.success, s.env_s = episode, 0, 0, 0.0, False, 0.0
    if progress is not None:
        progress[s.slot % len(progress)] = episode
    started = time.perf_counter()
    obs = s.env.reset()
    s.env_s += time.perf_counter() - started
    _send_observation(job, s, req, worker_rank, obs)


def _send_observation(job: EnvJob, s: _Slot, req: Requester, worker_rank: int, obs: dict) -> None:
    s.last_obs = obs
    req.send(observation_message(s.slot, obs, worker=worker_rank, episode_id=s.episode,
                                 group_id=job.plan.group_of(s.episode), chunk_index=s.chunk))


def _execute(job: EnvJob, s: _Slot, actions: np.ndarray, delay: float) -> bool:
    """Execute the chunk's first rl.execute_steps actions (clipped to the task's bounds); True when the episode
    ended (success: the simulator's own criterion, or rl.max_episode_steps, or the simulator's end)."""
    low, high = s.bounds
    started = time.perf_counter()
    for action in actions[: job.execute_steps]:
        if delay:
            time.sleep(delay)
        act = np.clip(np.asarray(action[: len(low)], np.float32), low, high)
        obs, reward, success, done = s.env.step(act)
        s.steps += 1
        s.ret += float(reward)
        s.last_obs = obs
        s.success = s.success or bool(success)
        if s.success or done or s.steps >= job.max_episode_steps:
            s.env_s += time.perf_counter() - started
            return True
    s.env_s += time.perf_counter() - started
    return False


# ---- the env role's supervisor ----
PEER_GONE_EXIT = 75  # the child's exit code when its rollout worker went silent: no restart helps then


def _child(job: EnvJob, worker_rank: int, attempt: int, progress: Any, alive: Any) -> None:
    # Slurm's time-limit warning (USR2) reaches every process of the step, this one too: the actor saves and stops
    # the job, and this worker stops when its rollout worker says so. USR2's default action would kill it instead
    # (a spawned child has none of its parent's handlers) and cost a restart and its episodes in flight.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    os.environ.setdefault("MUJOCO_GL", "egl")
    try:
        run_env_worker(job, worker_rank, attempt, progress, alive=alive)
    except PeerTimeout as exc:
        print(f"env worker {worker_rank}: {exc}", flush=True)
        raise SystemExit(PEER_GONE_EXIT) from None


class EnvWorkerFailed(RunFailure):
    """The env worker died more often than its supervisor restarts it."""


def supervise_env_role(job: EnvJob, worker_rank: int, *, max_restarts: int = MAX_RESTARTS,
                       on_start: Callable[[Any], None] | None = None, hang_after_s: float | None = None) -> int:
    """The env role's process: run the worker in a spawned child; restart it when it dies or hangs (no heartbeat
    for `hang_after_s`, default rl.peer_timeout_s + HANG_GRACE_S; its episodes in flight re-run), at most
    `max_restarts` times, then fail naming it. Returns the restarts it took. `on_start(process)`: called with each
    child once started (tests kill or stop one)."""
    ctx = multiprocessing.get_context("spawn")
    progress = ctx.Array("q", [NOT_STARTED] * job.envs_per_worker, lock=False)
    alive = ctx.Value("d", time.monotonic(), lock=False)
    bound = job.timeout_s + HANG_GRACE_S if hang_after_s is None else hang_after_s
    restarts = 0
    while True:
        alive.value = time.monotonic()  # a fresh worker's bound starts now (spawning and imports included)
        proc = ctx.Process(target=_child, args=(job, worker_rank, restarts, progress, alive),
                           name=f"env-worker-{worker_rank}", daemon=True)
        proc.start()
        if on_start is not None:
            on_start(proc)
        hung = watch_child(proc, alive, bound)
        if proc.exitcode == 0:
            return restarts
        if proc.exitcode == PEER_GONE_EXIT:
            raise EnvWorkerFailed(f"env worker {worker_rank}: its rollout worker ({job.rollout_name}) went silent "
                                  f"for {job.timeout_s:.0f} s (rl.peer_timeout_s)")
        why = f"hung (no heartbeat for {bound:.0f} s)" if hung else f"died (exit code {proc.exitcode})"
        if restarts >= max_restarts:
            raise EnvWorkerFailed(f"env worker {worker_rank} failed {restarts + 1} times (last: {why}); its "
                                  f"supervisor restarts it at most {max_restarts} times")
        restarts += 1
        print(f"env worker {worker_rank} {why}: restart {restarts} of at most {max_restarts}, its episodes in "
              f"flight re-run", flush=True)


def watch_child(proc: Any, alive: Any, bound_s: float, *, poll_s: float = WATCH_S) -> bool:
    """Wait for `proc` to end, or to hang: its heartbeat (`alive.value`, a time.monotonic() stamp) older than
    `bound_s`, when it is killed. True when it hung. Never waits without a bound: a worker that outlives its
    SIGKILL by KILL_WAIT_S is an EnvWorkerFailed."""
    while True:
        proc.join(poll_s)
        if proc.exitcode is not None:
            return False
        if time.monotonic() - alive.value > bound_s:
            proc.kill()
            proc.join(KILL_WAIT_S)
            if proc.exitcode is None:
                raise EnvWorkerFailed(f"env worker {proc.name} hung and outlived its SIGKILL by {KILL_WAIT_S:.0f} s")
            return True


__all__ = ["EnvJob", "EnvWorkerFailed", "EpisodePlan", "PeerTimeout", "run_env_worker", "supervise_env_role",
           "watch_child"]
