"""Level 1 of RL-VLA3 in the rollout worker: the envs that are ready are batched (`batch_ready`) once an env worker
has every one of its running envs waiting (it would idle), or every running env waits, and the wait for the rest is
bounded by BATCH_MAX_WAIT_S from the oldest arrival, also while other envs end their episodes; weights staged while
it waits go in before the batch. A fake server on a fake clock (no wall time): each poll delivers the next scheduled
message or lets the clock run out its timeout."""

from __future__ import annotations

import pytest

from embodyhpc.rl.codec import Message, episode_end_message
from embodyhpc.rl.env_worker import EpisodePlan
from embodyhpc.rl.rollout import BATCH_MAX_WAIT_S, RolloutSettings, RolloutWorker, batch_ready
from embodyhpc.rl.samples import EpisodeEnd

RUNNING = 16


class FakeServer:
    """poll(timeout): the next scheduled (time, message) if it comes within the timeout (the clock moves to it),
    else nothing once the clock has run the whole timeout."""

    def __init__(self, schedule: list[tuple[float, Message]], workers: int = 1) -> None:
        self.now, self.workers = 0.0, workers
        self.schedule = sorted(schedule, key=lambda item: item[0])
        self.polls = 0

    def clock(self) -> float:
        return self.now

    def poll(self, timeout_s: float) -> list[tuple[str, Message]]:
        self.polls += 1
        assert self.polls < 1000, "the batching wait does not end"
        if self.schedule and self.schedule[0][0] <= self.now + timeout_s:
            at, message = self.schedule.pop(0)
            self.now = max(self.now, at)
            return [(peer_of(int(message.fields["env_id"]), self.workers), message)]
        self.now += timeout_s
        return []


class StagedWeights:
    """The WeightReceiver's side the rollout uses: `staged_at` (fake clock) -> version, swapped in once due."""

    def __init__(self, server: FakeServer, staged_at: dict[float, int] | None = None) -> None:
        self.server, self.staged_at, self.finished = server, dict(staged_at or {}), False

    def swap_if_ready(self) -> int | None:
        due = [t for t in self.staged_at if t <= self.server.now]
        return self.staged_at.pop(max(due)) if due else None


class FakePusher:
    def __init__(self) -> None:
        self.pushed: list[Message] = []

    def push(self, message: Message, timeout_s: float) -> float:
        self.pushed.append(message)
        return 0.0


def observation(env_id: int) -> Message:
    return Message("observation", {"env_id": env_id, "episode_id": env_id, "group_id": 0, "chunk_index": 1})


def ended(env_id: int) -> Message:
    return episode_end_message(EpisodeEnd(env_id=env_id, episode_id=env_id, group_id=0, success=True,
                                          episode_return=1.0, length=5, version=0))


def peer_of(env_id: int, workers: int) -> str:
    """The env worker of `env_id` when the RUNNING envs are split over `workers` (env-0: the first ones, ...)."""
    return f"env-{env_id * workers // RUNNING}"


def worker(schedule: list[tuple[float, Message]], *, workers: int = 1, staged_at: dict[float, int] | None = None
           ) -> tuple[RolloutWorker, FakeServer, list[list[int]], FakePusher]:
    """An async rollout worker of RUNNING started envs on `workers` env workers, whose batches are recorded (at the
    fake clock, with the version in the model then) instead of sampled."""
    plan = EpisodePlan(("reach-v3",), (1,), 8, RUNNING, 32)
    settings = RolloutSettings(rank=0, slots=tuple(range(RUNNING)), plan=plan, sync=False, iterations=1,
                               denoise_steps=1, noise_level=0.5, peer_timeout_s=1.0, seed=0, max_batch=RUNNING)
    server, pusher = FakeServer(schedule, workers), FakePusher()
    rollout = RolloutWorker(None, None, server, pusher, StagedWeights(server, staged_at), settings)  # type: ignore
    rollout.clock = server.clock
    rollout.active = set(range(RUNNING))
    rollout.peers = {env_id: peer_of(env_id, workers) for env_id in range(RUNNING)}  # each said hello from its worker
    batches: list[list[int]] = []
    rollout.versions = []
    rollout.act = lambda requests: (batches.append(sorted(int(m.fields["env_id"]) for _, m in requests)),
                                    rollout.versions.append(rollout.version))
    return rollout, server, batches, pusher


def arrive(rollout: RolloutWorker, server: FakeServer, env_ids: list[int]) -> None:
    for env_id in env_ids:
        rollout._take(peer_of(env_id, server.workers), observation(env_id))


def test_every_running_env_ready_is_answered_at_once_in_one_batch():
    rollout, server, batches, _ = worker([(10.0, observation(0))])
    arrive(rollout, server, list(range(RUNNING)))
    rollout._answer()
    assert batches == [list(range(RUNNING))] and server.now == 0.0


def test_fewer_ready_envs_wait_exactly_the_bound_then_go_on_without_the_stragglers():
    """Fifteen of sixteen ready (the last one due in 10 s), or three: the bound, then on without it."""
    for ready in (list(range(RUNNING - 1)), [0, 1, 2]):
        rollout, server, batches, _ = worker([(10.0, observation(RUNNING - 1))])
        arrive(rollout, server, ready)
        rollout._answer()
        assert batches == [ready] and server.now == pytest.approx(BATCH_MAX_WAIT_S)


def test_the_bound_counts_from_the_oldest_arrival_while_others_end_episodes_and_trickle_in():
    """Envs ending their episodes (episode_end, forwarded to the actor) and single observations arriving every
    0.4 x the bound, never eight at once: the batch goes at BATCH_MAX_WAIT_S after the first observation, not after
    the last arrival (which would wait until the trickle fills every env, or forever if it never does)."""
    step = 0.4 * BATCH_MAX_WAIT_S
    schedule = []
    for i in range(1, 12):
        schedule += [(step * i - 0.01, ended(100 + i)), (step * i, observation(i))]
    rollout, server, batches, pusher = worker(schedule)
    arrive(rollout, server, [0])
    rollout._answer()
    assert server.now <= BATCH_MAX_WAIT_S and batches == [[0, 1, 2]]
    assert [m.kind for m in pusher.pushed] == ["episode_end"] * 2  # forwarded meanwhile, not held


def test_an_env_worker_whose_every_env_waits_is_answered_at_once_with_whoever_else_waits():
    """Two env workers of eight envs: all of env-1's and two of env-0's wait -> one batch at once (env-1 would idle
    otherwise); seven of env-1's and five of env-0's -> no worker idles (each steps an env meanwhile): the bound."""
    rollout, server, batches, _ = worker([(10.0, observation(15))], workers=2)
    arrive(rollout, server, [0, 1, *range(8, 16)])
    rollout._answer()
    assert batches == [[0, 1, *range(8, 16)]] and server.now == 0.0
    rollout, server, batches, _ = worker([(10.0, observation(15))], workers=2)
    arrive(rollout, server, [*range(5), *range(8, 15)])
    rollout._answer()
    assert batches == [[*range(5), *range(8, 15)]] and server.now == pytest.approx(BATCH_MAX_WAIT_S)


def test_an_env_worker_is_idle_when_its_running_envs_wait_not_counting_those_stopped():
    """env-1's env 15 is not running (its worker restarts it, or it was never started): env-1's seven others waiting
    make it idle; with env 15 running, they do not."""
    for running in (False, True):
        rollout, server, batches, _ = worker([(10.0, observation(15))], workers=2)
        if not running:
            rollout.active.discard(15)
        arrive(rollout, server, [0, *range(8, 15)])
        rollout._answer()
        assert batches == [[0, *range(8, 15)]]
        assert server.now == (pytest.approx(BATCH_MAX_WAIT_S) if running else 0.0)


def test_weights_staged_while_a_batch_waits_go_in_before_it():
    """Version 3 staged at 0.3 s while three envs wait for the bound: the batch is sampled with version 3."""
    rollout, server, batches, _ = worker([(10.0, observation(15))], staged_at={0.3: 3})
    arrive(rollout, server, [0, 1, 2])
    rollout._answer()
    assert batches == [[0, 1, 2]] and rollout.versions == [3] and rollout.version == 3


def test_batch_ready_rule_by_hand():
    assert batch_ready(32, running=32, oldest_wait_s=0.0, max_batch=32)
    assert not batch_ready(31, running=32, oldest_wait_s=0.0, max_batch=32)
    assert not batch_ready(16, running=32, oldest_wait_s=BATCH_MAX_WAIT_S - 1e-3, max_batch=32)
    assert batch_ready(1, running=32, oldest_wait_s=BATCH_MAX_WAIT_S, max_batch=32)  # a straggler's peers go on
    assert batch_ready(4, running=32, oldest_wait_s=0.0, max_batch=4)  # the cap
    assert batch_ready(1, running=1, oldest_wait_s=0.0, max_batch=8) and not batch_ready(0, 8, 1.0, 8)
    assert batch_ready(3, running=32, oldest_wait_s=0.0, max_batch=32, worker_idle=True)  # a worker would idle
    assert not batch_ready(0, running=32, oldest_wait_s=0.0, max_batch=32, worker_idle=True)
