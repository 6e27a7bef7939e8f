"""The rollout role: a worker that answers its env workers' observations with Flow-SDE action chunks and streams
every decision to the actor.

    worker = RolloutWorker(policy, server, pusher, weights, settings)
    worker.run()                    # until the actor's last version arrives; then every env worker is told to stop

Dynamic batching by readiness (level 1): the observations that have arrived are batched, up to a cap, once an env
worker would otherwise idle (every one of its running envs waits for an action: an env worker steps its envs one
after the other, so until then it has work), once every running env waits, or once the oldest waiting one has waited
BATCH_MAX_WAIT_S (`batch_ready`; measured from the oldest arrival, so a trickle of arrivals cannot stretch it). A slow
env worker never holds up the others (its waiting envs ride along in their batches), and the policy is not called
once per env: on a shared CPU a batch of one costs nearly what a batch of sixteen does. Measured on 2 cores
(bench/rl_async.py, 2 env workers of 16 envs): answering after 50 ms made batches of 2.5 envs and cost 18 ms of
inference per sample against 2.9 ms in sync's batches of 29; this rule batches 26 envs at 2.9 ms. Synchronous mode
batches in lock-step instead: it waits for the observation of every env that is running an episode of the round,
however long that takes.

Each decision is sampled with Flow-SDE (rl.denoise_steps, rl.noise_level), sent back to its env, and pushed to the
actor at once as a ChunkSample stamped with the policy version that produced it (level 2: pieces, not episodes);
the Pusher blocks while the actor's queue is full (back-pressure, bounded by rl.peer_timeout_s). An env's
EpisodeEnd is forwarded as it comes. Weights: asynchronous mode swaps in new weights at a chunk boundary (between
two batches) as soon as they are staged; synchronous mode ends a round when all its episodes ended and waits for
the next version before it starts the next round (a round is a version: one optimizer step of the actor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from embodyhpc.rl.codec import Message, observation_from, sample_message
from embodyhpc.rl.env_worker import NOT_STARTED, EpisodePlan
from embodyhpc.rl.flow_sde import sample_chunk
from embodyhpc.rl.samples import ChunkSample
from embodyhpc.rl.transport import PeerTimeout

BATCH_MAX_WAIT_S = 1.0
"""Async: the longest an observation waits for its batch when no env worker is idle (its worker is stepping its
other envs meanwhile); the sync pipeline waits for every env, however slow."""
POLL_S = 0.2
"""The longest the worker blocks before it looks at its weights again."""


def batch_ready(pending: int, running: int, oldest_wait_s: float, max_batch: int, worker_idle: bool = False) -> bool:
    """Async: answer the `pending` observations now? Yes once min(max_batch, running) of the `running` envs wait,
    an env worker has every one of its running envs waiting (`worker_idle`), or the oldest has waited
    BATCH_MAX_WAIT_S."""
    if pending <= 0:
        return False
    return pending >= max(1, min(max_batch, running)) or worker_idle or oldest_wait_s >= BATCH_MAX_WAIT_S


class WeightSource(Protocol):
    """What the rollout needs of embodyhpc.rl.weight_sync's WeightReceiver (started)."""

    finished: bool

    def swap_if_ready(self) -> int | None: ...

    def wait_ready(self, timeout_s: float | None = None) -> bool: ...


@dataclass(frozen=True)
class RolloutSettings:
    rank: int
    slots: tuple[int, ...]
    """The env slots (EpisodePlan) of the env workers this worker serves."""
    plan: EpisodePlan
    sync: bool
    iterations: int
    denoise_steps: int
    noise_level: float
    peer_timeout_s: float
    seed: int
    max_batch: int = 1024


class RolloutWorker:
    def __init__(self, model: Any, observation_batch: Any, server: Any, pusher: Any, weights: WeightSource,
                 settings: RolloutSettings, *, action_dims: int | None = None) -> None:
        self.model, self.observation_batch = model, observation_batch
        self.server, self.pusher, self.weights, self.s = server, pusher, weights, settings
        self.action_dims = action_dims
        self.generator = torch.Generator().manual_seed(settings.seed * 1009 + settings.rank)
        self.version = 0
        self.pending: dict[int, tuple[str, Message]] = {}  # env id -> (peer, observation) awaiting an action
        self.arrived: dict[int, float] = {}  # env id -> when its pending observation came (self.clock)
        self.clock = time.monotonic  # what the batching bound is measured with (a test's own clock)
        self.waiting: dict[int, str] = {}  # sync: env id -> peer waiting for the next round
        self.active: set[int] = set()  # envs that were told to start
        self.remaining: dict[int, int] = {}  # sync: episodes of the round each env slot has still to end
        self.peers: dict[int, str] = {}
        self.round = 0
        self.ended_in_round = 0
        self.stats = {"batches": 0, "samples": 0, "infer_s": 0.0, "push_wait_s": 0.0}
        self.push_wait_unreported = 0.0  # blocked on the actor's full queue, not yet told to it (next sample's field)

    # ---- the loop ----
    def run(self, start_version: int) -> dict[str, float]:
        self.version = self.round = start_version
        self._plan_round()
        last_heard = time.monotonic()
        while not self.done():
            if not self.s.sync:
                swapped = self.weights.swap_if_ready()  # a chunk boundary: between two batches
                if swapped is not None:
                    self.version = swapped
                    continue
            messages = self.server.poll(POLL_S)
            if messages:
                last_heard = time.monotonic()
            elif time.monotonic() - last_heard > self.s.peer_timeout_s:
                raise PeerTimeout(f"the env workers of rollout {self.s.rank}", self.s.peer_timeout_s)
            for peer, message in messages:
                self._take(peer, message)
            if self.s.sync and self.ended_in_round >= self._expected_in_round():
                self._next_round()
                continue
            self._answer()
        for peer in sorted(set(self.peers.values())):  # the last version is in: every env worker stops
            try:
                self.server.reply(peer, Message("stop", {"reason": "the actor's last version is in"}))
            except PeerTimeout:
                pass
        return dict(self.stats)

    def done(self) -> bool:
        """The actor's last version is in: rl.iterations reached, or the actor stopped early (preemption)."""
        return self.version >= self.s.iterations or bool(self.weights.finished)

    def _take(self, peer: str, message: Message) -> None:
        env_id = int(message.fields.get("env_id", -1))
        self.peers[env_id] = peer
        if message.kind == "hello":
            wanted = int(message.fields.get("round", NOT_STARTED))
            if self.s.sync and wanted > self.round:
                self.waiting[env_id] = peer
                self.active.discard(env_id)
            else:
                self._start(env_id, peer)
        elif message.kind == "observation":
            self.pending[env_id] = (peer, message)
            self.arrived.setdefault(env_id, self.clock())
        elif message.kind == "episode_end":
            self._push(message)
            if self.s.sync and self.s.plan.round_of(int(message.fields["episode_id"])) == self.round:
                self.ended_in_round += 1
                self.remaining[env_id] = self.remaining.get(env_id, 1) - 1

    def _start(self, env_id: int, peer: str) -> None:
        self.active.add(env_id)
        self.pending.pop(env_id, None)  # a restarted env worker: its old request is void
        self.arrived.pop(env_id, None)
        self.server.reply(peer, Message("hello", {"env_id": env_id, "round": self.round}))

    def _expected_in_round(self) -> int:
        return self.s.plan.episodes_in_round(self.s.slots, self.round)

    def _plan_round(self) -> None:
        """Sync: how many episodes of the round each slot runs (a batch waits for every slot with one left)."""
        if self.s.sync:
            self.remaining = {slot: self.s.plan.episodes_in_round([slot], self.round) for slot in self.s.slots}

    def _next_round(self) -> None:
        """Sync: every episode of the round ended: wait for the actor's next version, then release the envs."""
        started = time.monotonic()

        def heartbeat() -> None:
            for peer in set(self.waiting.values()):
                self.server.heartbeat(peer)

        self.version = self._wait_newer(heartbeat)
        self.stats["sync_wait_s"] = self.stats.get("sync_wait_s", 0.0) + time.monotonic() - started
        self.round, self.ended_in_round = self.round + 1, 0
        self._plan_round()
        if self.done():
            return
        for env_id, peer in sorted(self.waiting.items()):
            self._start(env_id, peer)
        self.waiting.clear()

    def _wait_newer(self, heartbeat: Any) -> int:
        """Sync: block (bounded by rl.peer_timeout_s, the env workers kept alive meanwhile) until the actor's next
        version is in the model; the current one after the actor's goodbye."""
        deadline = time.monotonic() + self.s.peer_timeout_s
        while True:
            try:
                ready = self.weights.wait_ready(min(1.0, max(deadline - time.monotonic(), 0.001)))
            except PeerTimeout:
                if time.monotonic() > deadline:
                    raise
                ready = False
            if ready:
                version = self.weights.swap_if_ready()
                if version is not None and version > self.version:
                    return version
            elif self.weights.finished:
                return self.version
            if time.monotonic() > deadline:
                raise PeerTimeout("actor 0", self.s.peer_timeout_s, "sent no new weights")
            heartbeat()

    def _answer(self) -> None:
        """One batch of the observations waiting: once `batch_ready` says so (async; the wait bounded by
        BATCH_MAX_WAIT_S from the oldest arrival), or only once every running env has sent one (sync)."""
        if not self.pending:
            return
        if self.s.sync:
            if not {slot for slot, left in self.remaining.items() if left > 0} <= set(self.pending):
                return
        else:
            while self.pending:
                waited = self.clock() - min(self.arrived[e] for e in self.pending)
                if batch_ready(len(self.pending), len(self.active), waited, self.s.max_batch, self._worker_idle()):
                    break
                swapped = self.weights.swap_if_ready()  # between two batches: staged weights go in while it waits
                if swapped is not None:
                    self.version = swapped
                for peer, message in self.server.poll(min(max(BATCH_MAX_WAIT_S - waited, 0.0), POLL_S)):
                    self._take(peer, message)
            if not self.pending:  # a restarted env worker voided them meanwhile
                return
        chosen = sorted(self.pending)[: self.s.max_batch]
        requests = [self.pending.pop(env_id) for env_id in chosen]
        for env_id in chosen:
            self.arrived.pop(env_id, None)
        self.act(requests)

    def _worker_idle(self) -> bool:
        """Async: does an env worker (a peer) have every one of its running envs waiting for an action?"""
        waiting: dict[str, bool] = {}
        for env_id in self.active:
            peer = self.peers.get(env_id)
            waiting[peer] = waiting.get(peer, True) and env_id in self.pending
        return any(idle for peer, idle in waiting.items() if peer is not None)

    def act(self, requests: list[tuple[str, Message]]) -> None:
        """Sample one chunk per observation (one batch), reply to each env, push each decision to the actor; every
        decision is stamped with the version that sampled it, also when a push blocked on the actor's full queue
        swaps in newer weights before the batch's last decisions are pushed."""
        started = time.perf_counter()
        version = self.version
        decoded = [observation_from(message) for _, message in requests]
        batch = self.observation_batch([obs for _, obs, _ in decoded])
        device = next(iter(self.model.parameters()), torch.empty(0)).device  # a GPU rollout worker: its batch there
        if device.type != "cpu":
            batch = batch.to(device)
        shape = (len(requests), self.model.action_horizon, self.model.action_dim)
        noise = torch.randn(shape, generator=self.generator).to(device)  # drawn on the CPU: the same on any device
        with torch.no_grad():
            out = sample_chunk(self.model.flow_velocity_fn(batch), noise, num_steps=self.s.denoise_steps,
                               noise_level=self.s.noise_level, generator=self.generator)
        trajectory = out.trajectory.float().cpu().numpy()
        log_prob = out.log_prob.float().cpu().numpy()
        infer_s = time.perf_counter() - started
        self.stats["infer_s"] += infer_s
        self.stats["batches"] += 1
        dims = self.action_dims or shape[2]
        for i, ((peer, _), (env_id, obs, fields)) in enumerate(zip(requests, decoded, strict=True)):
            actions = trajectory[i, -1, :, :dims]
            try:
                self.server.reply(peer, Message("action", {"env_id": env_id, "version": version},
                                                {"actions": np.ascontiguousarray(actions)}))
            except PeerTimeout:  # its env worker died: the restarted one re-runs the episode
                self.active.discard(env_id)
                continue
            sample = ChunkSample(env_id=env_id, episode_id=int(fields["episode_id"]),
                                 group_id=int(fields["group_id"]), chunk_index=int(fields["chunk_index"]),
                                 observation=obs, trajectory=trajectory[i], log_prob=log_prob[i],
                                 version=version)
            message = sample_message(sample)
            unreported, self.push_wait_unreported = self.push_wait_unreported, 0.0
            message.fields.update(infer_s=infer_s / len(requests), rollout=self.s.rank, push_wait_s=unreported)
            self._push(message)
            self.stats["samples"] += 1

    def _push(self, message: Message) -> None:
        """To the actor, blocking while its queue is full; gives up quietly once the actor's last version is in
        (the actor stopped reading), raises PeerTimeout after rl.peer_timeout_s otherwise."""
        deadline = time.monotonic() + self.s.peer_timeout_s
        while True:
            try:
                waited = self.pusher.push(message, timeout_s=min(POLL_S * 5, self.s.peer_timeout_s))
                self.stats["push_wait_s"] += waited
                self.push_wait_unreported += waited
                return
            except PeerTimeout:
                swapped = None if self.s.sync else self.weights.swap_if_ready()
                if swapped is not None:
                    self.version = swapped
                if self.done():
                    return
                if time.monotonic() > deadline:
                    raise
