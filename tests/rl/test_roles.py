"""The env and rollout roles over real zmq sockets, with a walk-along-a-line suite (tests/eval/fake_suite.py) and a
tiny stand-in policy whose velocity is a known formula: the episode plan, dynamic batching (a slow env does not hold
up a fast one), lock-step rounds in sync mode, the samples' log-probabilities against an independent Gaussian
density, and a killed env worker whose episodes re-run."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from embodyhpc.rl.codec import Codec, episode_end_from, sample_from
from embodyhpc.rl.env_worker import (
    EnvJob,
    EnvWorkerFailed,
    EpisodePlan,
    run_env_worker,
    supervise_env_role,
    watch_child,
)
from embodyhpc.rl.rollout import RolloutSettings, RolloutWorker
from embodyhpc.rl.transport import Puller, Pusher, Server
from tests.eval.fake_suite import LineSuite

KEY = b"k" * 32
H, A, K, NOISE = 4, 1, 2, 0.5


class LinePolicy(torch.nn.Module):
    """v(x, t) = x - 1 (the ODE pulls x towards +1): simple enough to score by hand."""

    action_horizon, action_dim = H, A

    def flow_velocity_fn(self, batch):
        return lambda x, t: x - 1.0


def line_batch(observations):
    return torch.tensor([[float(o["observation.state"][0])] for o in observations])


def manual_log_prob(trajectory: np.ndarray) -> np.ndarray:
    """Per-entry Gaussian log-density of each step, Flow-SDE written out (t clamped at 1 - dt, sigma_t as in πRL)."""
    out = []
    for k in range(K):
        t, dt = 1.0 - k / K, -1.0 / K
        x = trajectory[k].astype(np.float64)
        v = x - 1.0
        sigma2 = NOISE ** 2 * t / max(1.0 - t, -dt)
        mean = x + dt * (v + sigma2 / (2 * t) * (x + (1 - t) * v))
        var = sigma2 * -dt
        out.append(-((trajectory[k + 1] - mean) ** 2) / (2 * var) - 0.5 * math.log(2 * math.pi * var))
    return np.stack(out)


class FakeWeights:
    """No new weights while a round runs; the next version at once when a sync round waits for it."""

    def __init__(self) -> None:
        self.finished, self.current, self.staged = False, 0, None

    def swap_if_ready(self):
        version, self.staged = self.staged, None
        if version is not None:
            self.current = version
        return version

    def wait_ready(self, timeout_s=None):
        if self.finished:
            return False
        self.staged = self.current + 1
        return True


def test_episode_plan_groups_share_initial_states_and_slots_cover_each_episode_once():
    plan = EpisodePlan(tasks=("a", "b"), train_seeds=(5, 6), group_size=4, num_slots=3, episodes_per_round=8)
    states = [plan.initial_state(e) for e in range(32)]
    for e in range(32):  # a group is one initial state; different groups differ
        assert states[e] == states[e // 4 * 4]
    assert len({states[g * 4] for g in range(8)}) == 8
    assert states[0] == ("a", 5, 0) and states[4] == ("b", 5, 0) and states[8] == ("a", 6, 0) and states[16] == (
        "a", 5, 1)
    for round_ in range(3):  # each slot runs e = slot mod 3 from its first episode on; together: each once
        start, end = round_ * 8, (round_ + 1) * 8
        runs = sorted(e for s in range(3) for e in range(plan.first_episode(s, round_), end, 3))
        assert runs == list(range(start, end))
        assert plan.episodes_in_round(range(3), round_) == 8
        assert plan.episodes_in_round([1], round_) == len([e for e in range(start, end) if e % 3 == 1])


class Harness:
    """One rollout worker (thread), env workers (threads), the actor's end of the stream (a Puller)."""

    def __init__(self, *, sync: bool, workers: int, envs_per_worker: int, delays: dict[int, float],
                 iterations: int = 1000, episodes_per_round: int = 2, limit: int = 4, group_size: int = 1) -> None:
        self.plan = EpisodePlan(("walk",), (0,), group_size, workers * envs_per_worker, episodes_per_round)
        self.puller = Puller(Codec(KEY, sender="actor-0"), hwm=64, timeout_s=10.0)
        self.server = Server(Codec(KEY, sender="rollout-0"), timeout_s=10.0)
        self.weights = FakeWeights()
        settings = RolloutSettings(rank=0, slots=tuple(range(workers * envs_per_worker)), plan=self.plan, sync=sync,
                                   iterations=iterations, denoise_steps=K, noise_level=NOISE, peer_timeout_s=10.0,
                                   seed=0, max_batch=workers * envs_per_worker)
        self.rollout = RolloutWorker(LinePolicy(), line_batch, self.server,
                                     Pusher(self.puller.address, Codec(KEY, sender="rollout-0"), peer="actor 0",
                                            hwm=64, timeout_s=10.0), self.weights, settings)
        self.jobs = [EnvJob(suite="tests.eval.fake_suite:LineSuite", tasks=("walk",), cameras=(), image_size=16,
                            suite_options={"limit": limit}, plan=self.plan, sync=sync,
                            envs_per_worker=envs_per_worker, execute_steps=H, max_episode_steps=limit,
                            straggler_delay_s=delays.get(w, 0.0), rollout_address=self.server.address,
                            rollout_name="rollout 0", key=KEY, timeout_s=10.0) for w in range(workers)]
        self.samples, self.ends = [], []
        self.errors: list[BaseException] = []

    def _guard(self, fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def start(self, env_target=None):
        self.threads = [threading.Thread(target=self._guard, args=(self.rollout.run, 0), daemon=True)]
        for w, job in enumerate(self.jobs):
            target = env_target or (lambda job=job, w=w: run_env_worker(
                job, w, make_suite=lambda _n, tasks, **kw: LineSuite(tasks, **kw)))
            self.threads.append(threading.Thread(target=self._guard, args=(target,), daemon=True))
        for thread in self.threads:
            thread.start()

    def collect_until(self, done, timeout_s: float = 20.0, on_sample=None):
        deadline = time.monotonic() + timeout_s
        while not done() and time.monotonic() < deadline:
            for message in self.puller.pull_many(64, timeout_s=5.0):
                if message.kind == "chunk_sample":
                    self.samples.append(sample_from(message))
                    if on_sample is not None:
                        on_sample(self.samples[-1])
                else:
                    self.ends.append(episode_end_from(message))
        assert done(), f"not done in {timeout_s} s: {len(self.ends)} episodes ended; errors {self.errors}"

    def finish(self):
        self.weights.finished = True
        for thread in self.threads:
            thread.join(10.0)
        assert not any(t.is_alive() for t in self.threads)
        assert not self.errors, self.errors
        self.server.close()
        self.puller.close()


def check_samples(samples, ends, plan, sync):
    """Every decision: shapes, the behaviour log-probability against the hand-written density, contiguous chunks."""
    assert samples and ends
    chunks: dict[int, list[int]] = {}
    for s in samples:
        assert s.trajectory.shape == (K + 1, H, A) and s.log_prob.shape == (K, H, A)
        np.testing.assert_allclose(s.log_prob, manual_log_prob(s.trajectory), rtol=1e-4, atol=1e-4)
        assert s.group_id == plan.group_of(s.episode_id)
        assert s.version == (plan.round_of(s.episode_id) if sync else 0)  # sync: round r runs version r
        chunks.setdefault(s.episode_id, []).append(s.chunk_index)
    for end in ends:
        assert chunks[end.episode_id] == list(range(len(chunks[end.episode_id])))
        assert (len(chunks[end.episode_id]) - 1) * H < end.length <= len(chunks[end.episode_id]) * H


def test_async_a_slow_env_does_not_hold_up_a_fast_one():
    h = Harness(sync=False, workers=2, envs_per_worker=1, delays={0: 0.25})
    h.start()
    h.collect_until(lambda: sum(e.env_id == 1 for e in h.ends) >= 4)
    h.finish()
    fast = sum(e.env_id == 1 for e in h.ends)
    slow = sum(e.env_id == 0 for e in h.ends)
    # the straggler's episodes take >= 4 x 0.25 s each; the fast env went on meanwhile (lock-step batching would
    # keep the two within one episode of each other)
    assert fast >= 4 and slow <= 1
    assert h.rollout.stats["samples"] / h.rollout.stats["batches"] < 2  # batches of whoever was ready
    check_samples(h.samples, h.ends, h.plan, sync=False)


def test_sync_rounds_are_lock_step_and_wait_for_every_env():
    # two chunks per episode: the straggler's second observation comes 4 x 0.03 s after the fast env's
    h = Harness(sync=True, workers=2, envs_per_worker=1, delays={0: 0.03}, iterations=2, episodes_per_round=2,
                limit=8)
    h.start()
    h.collect_until(lambda: len(h.ends) >= 4)
    h.finish()
    assert sorted(e.episode_id for e in h.ends) == [0, 1, 2, 3]  # round 0: episodes 0, 1; round 1: 2, 3
    assert h.rollout.stats["samples"] == 2 * h.rollout.stats["batches"]  # every batch: both envs' observations
    check_samples(h.samples, h.ends, h.plan, sync=True)


@pytest.mark.slow  # spawns the env worker twice (~4 s); the actor's side of a re-run: test_pipeline's assembler test
def test_a_killed_env_worker_is_restarted_and_its_episodes_rerun():
    children: list = []
    h = Harness(sync=True, workers=1, envs_per_worker=2, delays={0: 0.05}, iterations=2, episodes_per_round=2,
                limit=8)
    h.start(env_target=lambda: supervise_env_role(h.jobs[0], 0, on_start=children.append))

    def kill_first_child(sample):  # its first decision is out: both episodes of round 0 are in flight (2 chunks)
        if len(children) == 1 and children[0].is_alive():
            children[0].kill()

    h.collect_until(lambda: len(h.ends) >= 4, timeout_s=60.0, on_sample=kill_first_child)
    h.finish()
    assert len(children) == 2 and children[0].exitcode != 0
    assert sorted(e.episode_id for e in h.ends) == [0, 1, 2, 3]  # every episode ended once: the run finished
    firsts = [s.episode_id for s in h.samples if s.chunk_index == 0]
    assert any(firsts.count(e) > 1 for e in (0, 1))  # an episode in flight ran again from its start


class _Child:
    """A worker process as watch_child sees it: it ends after `ends_after` joins (never, when None), stamping its
    heartbeat at each join while `beats`; SIGKILL ends it unless `unkillable`. Fails the test where a watcher
    would wait on it forever (an unbounded join, or 200 bounded ones without a look at the heartbeat)."""

    name = "env-worker-0"

    def __init__(self, alive, *, ends_after=None, beats=False, unkillable=False):
        self.alive, self.ends_after, self.beats, self.unkillable = alive, ends_after, beats, unkillable
        self.exitcode, self.joins, self.killed = None, [], False

    def join(self, timeout=None):
        assert timeout is not None, "an unbounded join on the env worker"
        assert len(self.joins) < 200, "the watcher waits on a hung worker forever"
        self.joins.append(timeout)
        if self.beats:
            self.alive.value = time.monotonic()
        if self.ends_after is not None and len(self.joins) >= self.ends_after:
            self.exitcode = 0

    def kill(self):
        self.killed = True
        if not self.unkillable:
            self.exitcode = -9


class _Stamp:
    def __init__(self, value):
        self.value = value


def test_the_supervisor_kills_a_worker_without_heartbeat_and_waits_on_a_beating_one():
    """A stopped worker neither ends nor beats: killed once its stamp is older than the bound, never waited on
    without a bound. A slow but live worker (it beats) is waited on however long it takes. The stamps are set
    100 s apart from the bound of 5 s either way: the machine's speed does not decide."""
    stopped = _Child(_Stamp(time.monotonic() - 100.0))
    assert watch_child(stopped, stopped.alive, 5.0, poll_s=0.01) is True and stopped.killed
    live = _Child(_Stamp(time.monotonic()), ends_after=20, beats=True)
    assert watch_child(live, live.alive, 100.0, poll_s=0.001) is False and not live.killed
    assert len(live.joins) == 20
    stuck = _Child(_Stamp(time.monotonic() - 100.0), unkillable=True)
    with pytest.raises(EnvWorkerFailed, match="hung and outlived its SIGKILL"):
        watch_child(stuck, stuck.alive, 5.0, poll_s=0.01)
    assert all(t is not None for t in stuck.joins)


@pytest.mark.slow  # spawns the env worker twice (~4 s) and waits out the bound of 2 s
def test_a_stopped_env_worker_is_killed_within_its_bound_and_replaced():
    """SIGSTOP: the worker is alive but silent. Its supervisor kills it once its heartbeat is 2 s old and
    restarts it; the episodes in flight re-run and the run finishes. With an unbounded join the supervisor would
    wait on the stopped worker forever and the run never finish."""
    children: list = []
    h = Harness(sync=True, workers=1, envs_per_worker=2, delays={0: 0.05}, iterations=2, episodes_per_round=2,
                limit=8)
    h.start(env_target=lambda: supervise_env_role(h.jobs[0], 0, on_start=children.append, hang_after_s=2.0))

    def stop_first_child(sample):
        if len(children) == 1 and children[0].is_alive():
            os.kill(children[0].pid, signal.SIGSTOP)

    try:
        h.collect_until(lambda: len(h.ends) >= 4, timeout_s=40.0, on_sample=stop_first_child)
        h.finish()
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
    assert len(children) == 2 and children[0].exitcode == -signal.SIGKILL
    assert sorted(e.episode_id for e in h.ends) == [0, 1, 2, 3]
    firsts = [s.episode_id for s in h.samples if s.chunk_index == 0]
    assert any(firsts.count(e) > 1 for e in (0, 1))  # an episode in flight ran again from its start


@pytest.mark.slow  # spawns the env worker (~2 s)
def test_the_time_limit_warning_does_not_kill_the_env_worker():
    """Slurm's USR2 reaches every process of the step: the env worker (a spawned child, without its parent's
    handlers) must live on and stop when its rollout worker says so, not die and be restarted."""
    children: list = []
    h = Harness(sync=True, workers=1, envs_per_worker=2, delays={0: 0.05}, iterations=2, episodes_per_round=2,
                limit=8)
    h.start(env_target=lambda: supervise_env_role(h.jobs[0], 0, on_start=children.append))

    def warn_child(sample):
        if len(children) == 1 and sample.chunk_index == 0 and sample.episode_id == 0:
            os.kill(children[0].pid, signal.SIGUSR2)

    h.collect_until(lambda: len(h.ends) >= 4, timeout_s=40.0, on_sample=warn_child)
    h.finish()
    assert len(children) == 1 and children[0].exitcode == 0  # warned, never restarted, ended cleanly


@pytest.mark.parametrize("kind", ["env", "rollout"])
def test_a_silent_peer_ends_the_role_within_its_bound(kind):
    """No rollout behind the address: the env worker raises PeerTimeout naming it, after its timeout."""
    from embodyhpc.rl.transport import PeerTimeout

    server = Server(Codec(KEY, sender="rollout-0"), timeout_s=0.5)
    plan = EpisodePlan(("walk",), (0,), 1, 1, 1)
    if kind == "env":
        job = EnvJob(suite="tests.eval.fake_suite:LineSuite", tasks=("walk",), cameras=(), image_size=16,
                     suite_options={}, plan=plan, sync=True, envs_per_worker=1, execute_steps=H, max_episode_steps=4,
                     straggler_delay_s=0.0, rollout_address=server.address, rollout_name="rollout 0", key=KEY,
                     timeout_s=0.5)
        call = lambda: run_env_worker(job, 0)  # noqa: E731
    else:
        settings = RolloutSettings(rank=0, slots=(0,), plan=plan, sync=True, iterations=5, denoise_steps=K,
                                   noise_level=NOISE, peer_timeout_s=0.5, seed=0)
        worker = RolloutWorker(LinePolicy(), line_batch, server, None, FakeWeights(), settings)
        call = lambda: worker.run(0)  # noqa: E731
    started = time.monotonic()
    with pytest.raises(PeerTimeout, match="rollout 0|env workers of rollout 0"):
        call()
    assert time.monotonic() - started < 5.0
    server.close()


def test_a_batch_keeps_the_version_that_sampled_it_when_a_blocked_push_swaps_weights():
    """The actor's queue is full at the batch's first push: while it waits the rollout swaps in version 6 (so the
    actor can finish its broadcast), but the batch was sampled with version 5: every decision of it, pushed and
    replied, says 5; the next batch says 6."""
    from embodyhpc.rl.codec import Message, observation_message
    from embodyhpc.rl.transport import PeerTimeout

    class Replies:
        def __init__(self) -> None:
            self.sent: list[Message] = []

        def reply(self, peer, message) -> None:
            self.sent.append(message)

    class FullOnce:
        def __init__(self) -> None:
            self.pushed, self.full = [], True

        def push(self, message, timeout_s) -> float:
            if self.full:
                self.full = False
                raise PeerTimeout("actor 0", timeout_s)
            self.pushed.append(message)
            return 0.0

    weights = FakeWeights()
    weights.current, weights.staged = 5, 6
    plan = EpisodePlan(("walk",), (0,), 1, 2, 2)
    settings = RolloutSettings(rank=0, slots=(0, 1), plan=plan, sync=False, iterations=100, denoise_steps=K,
                               noise_level=NOISE, peer_timeout_s=5.0, seed=0)
    server, pusher = Replies(), FullOnce()
    worker = RolloutWorker(LinePolicy(), line_batch, server, pusher, weights, settings)
    worker.version = 5

    def requests():
        return [("env-0", observation_message(e, {"observation.state": np.zeros(1, np.float32)}, worker=0,
                                              episode_id=e, group_id=e, chunk_index=0)) for e in (0, 1)]

    worker.act(requests())
    assert worker.version == 6  # swapped while the push waited
    assert [sample_from(m).version for m in pusher.pushed] == [5, 5]
    assert [m.fields["version"] for m in server.sent] == [5, 5]
    worker.act(requests())
    assert [sample_from(m).version for m in pusher.pushed[2:]] == [6, 6]
