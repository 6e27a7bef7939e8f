"""The actor's side of the pipeline on gloo, without a policy model: episodes assembled from streamed pieces (a
re-run episode replaces its dead attempt), staleness admission end to end (a sample older than rl.max_staleness
never reaches a loss), weights equal on every rollout worker after a sync (only the trainable ones sent), and a
silent rollout worker ending the actor within its bound."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from embodyhpc.rl.actor import Actor
from embodyhpc.rl.assembly import Assembler, Window
from embodyhpc.rl.codec import Codec, episode_end_message, sample_message
from embodyhpc.rl.endpoints import free_port
from embodyhpc.rl.rollout import RolloutSettings, RolloutWorker
from embodyhpc.rl.samples import ChunkSample, EpisodeEnd, StalenessGate, VersionCounter
from embodyhpc.rl.transport import PeerTimeout, Puller
from embodyhpc.rl.weight_sync import WeightReceiver, WeightSender, standalone_group, trainable_state


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-rank gloo world (the actor's own world with actor_ranks=1)."""
    store = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sample(episode: int, chunk: int, version: int, group: int | None = None) -> ChunkSample:
    return ChunkSample(env_id=0, episode_id=episode, group_id=episode // 2 if group is None else group,
                       chunk_index=chunk, observation={"observation.state": np.zeros(2, np.float32), "task": "t"},
                       trajectory=np.zeros((3, 2, 1), np.float32), log_prob=np.zeros((2, 2, 1), np.float32),
                       version=version)


def end(episode: int, success: bool, version: int = 0) -> EpisodeEnd:
    return EpisodeEnd(env_id=0, episode_id=episode, group_id=episode // 2, success=success, episode_return=1.0,
                      length=3, version=version)


def test_a_rerun_episode_replaces_the_pieces_of_its_dead_attempt():
    asm = Assembler(group_size=2)
    for message in [sample_message(sample(0, 0, 0)), sample_message(sample(0, 1, 0)),  # attempt 1 dies here
                    sample_message(sample(0, 0, 0)), episode_end_message(end(0, True)),  # re-run: 1 chunk
                    sample_message(sample(1, 0, 0)), episode_end_message(end(1, False)),
                    episode_end_message(end(1, False))]:  # a duplicate end is ignored
        asm.take(message)
    (group,) = asm.complete_groups()
    assert [sorted(e.samples) for e in group] == [[0], [0]] and asm.restarted == 1
    assert not asm.complete_groups()


class FakePuller:
    def __init__(self, messages, per_pull: int | None = None):
        self.messages, self.per_pull = list(messages), per_pull  # per_pull: at most that many per pull

    def pull_many(self, n, timeout_s=None):
        if not self.messages:
            raise PeerTimeout("rollout workers", 0.0)
        n = min(n, self.per_pull or n)
        out, self.messages = self.messages[:n], self.messages[n:]
        return out


def bare_actor(*, version: int, max_staleness: int, asynchronous: bool, batch: int) -> Actor:
    """An Actor with its admission and step logic and a one-parameter model (no policy to build)."""
    actor = Actor.__new__(Actor)
    rl = SimpleNamespace(async_=asynchronous, algorithm="grpo", max_staleness=max_staleness, micro_batch_size=2,
                         episodes_per_iteration=4, group_size=2, peer_timeout_s=0.5)
    actor.config = SimpleNamespace(rl=rl, train=SimpleNamespace(global_batch_size=batch, grad_clip=1.0))
    actor.rl, actor.rank, actor.world, actor.group, actor.critic = rl, 0, 1, None, None
    actor.version, actor.gate = VersionCounter(version), StalenessGate(max_staleness)
    actor.model = torch.nn.Linear(1, 1)
    actor.optimizer = torch.optim.SGD(actor.model.parameters(), lr=0.1)
    actor.reached_loss, actor.micro_batches, actor.steps = [], [], 0
    step = actor._step

    def counted_step(window, consumed):
        actor.steps += 1
        step(window, consumed)

    def micro_batch(items, weight):  # records what reaches the loss
        actor.micro_batches.append(len(items))
        actor.reached_loss.extend((s.version, s.episode_id, a) for s, a in items if weight > 0)
        (actor.model.weight.sum() * 0.0).backward()
        return {"loss/policy": 0.0}

    actor._micro_batch, actor._step = micro_batch, counted_step
    return actor


def stream(versions: dict[int, int], successes: dict[int, bool]):
    """Two chunks per episode, each group of two episodes ending with one success and one failure."""
    for episode, version in versions.items():
        yield sample_message(sample(episode, 0, version))
        yield sample_message(sample(episode, 1, version))
        yield episode_end_message(end(episode, successes[episode], version))


@pytest.mark.usefixtures("one_rank")
def test_no_sample_older_than_max_staleness_reaches_a_loss():
    actor = bare_actor(version=3, max_staleness=1, asynchronous=True, batch=4)
    versions = {0: 1, 1: 1, 2: 2, 3: 3, 4: 3, 5: 2}  # episodes 0, 1 (version 1) are 2 versions behind
    puller = FakePuller(stream(versions, {e: e % 2 == 0 for e in versions}))
    window = Window()
    assert actor.next_step(puller, Assembler(2), window) is None
    # the three groups arrive in one pull: groups 1 and 2 admitted (8 samples, the step due at 4) and trained whole
    # in this step's micro-batches (2 samples each)
    assert actor.micro_batches == [2, 2, 2, 2] and window.samples == 8 and actor.steps == 1
    assert all(3 - v <= 1 for v, _, _ in actor.reached_loss)
    assert {e for _, e, _ in actor.reached_loss} == {2, 3, 4, 5}
    # GRPO: one success and one failure in a group of two: advantages +1 and -1 (population std)
    assert sorted({round(a, 4) for _, _, a in actor.reached_loss}) == [-1.0, 1.0]
    metrics = actor.gate.metrics()  # 3 groups = 12 samples reached the gate: lags 2, 2, 2, 2 | 1, 1, 0, 0 | 0, 0, 1, 1
    assert metrics["rl/rejected_stale"] == 4 and metrics["rl/rejected_stale_fraction"] == pytest.approx(4 / 12)
    assert metrics["rl/staleness_max"] == 2 and metrics["rl/staleness_mean"] == pytest.approx(12 / 12)


@pytest.mark.usefixtures("one_rank")
def test_an_async_step_trains_its_last_group_whole():
    """train.global_batch_size 6, groups of 4 samples arriving one at a time: the first group is trained as two
    micro-batches, the second one makes the step due (8 >= 6) and is trained whole in it, all 4 samples, rather than
    2 of them now and its other episode at the next version; the gradient is the mean over the 8 (rescaled from 6)."""
    actor = bare_actor(version=3, max_staleness=1, asynchronous=True, batch=6)
    actor.optimizer = torch.optim.SGD(actor.model.parameters(), lr=1.0)
    actor.config.train.grad_clip = 0.0  # no clipping: the step is the gradient itself
    actor.micro_batch = actor._micro_batch

    def unit_gradient(items, weight):  # d(loss)/d(bias) = weight: a mean over `total` samples gives 1 in all
        actor.micro_batch(items, weight)
        (actor.model.bias.sum() * weight).backward()
        return {"loss/policy": 0.0}

    actor._micro_batch = unit_gradient
    bias = float(actor.model.bias.detach())
    window = Window()
    versions = {2: 3, 3: 3, 4: 3, 5: 3}
    assert actor.next_step(FakePuller(stream(versions, {e: e % 2 == 0 for e in versions}), per_pull=3),
                           Assembler(2), window) is None
    assert actor.steps == 1 and actor.micro_batches == [2, 2, 2, 2] and window.samples == 8
    assert sorted({e for _, e, _ in actor.reached_loss}) == [2, 3, 4, 5]
    assert float(actor.model.bias.detach()) == pytest.approx(bias - 1.0)  # SGD, lr 1: one mean gradient of 1, not 8/6


def test_when_an_async_step_is_due_by_hand():
    """Actor._batch_due(informative, flat, target) with target 10: a step is due at 10 samples with a gradient; with
    fewer but some, once FLAT_BATCHES x 10 samples (both kinds) reached it; with none at FLAT_BATCHES_MAX x 10."""
    from embodyhpc.rl.actor import FLAT_BATCHES, FLAT_BATCHES_MAX

    due = Actor._batch_due
    assert (FLAT_BATCHES, FLAT_BATCHES_MAX) == (2, 8)
    assert due(10, 0, 10) and not due(9, 0, 10)
    assert due(1, 19, 10) and not due(1, 18, 10)  # 20 seen with 1 informative: step on that one
    assert due(0, 80, 10) and not due(0, 79, 10)  # nothing informative: a run still ends


@pytest.mark.usefixtures("one_rank")
def test_sync_steps_once_over_the_whole_round():
    actor = bare_actor(version=0, max_staleness=0, asynchronous=False, batch=4)
    versions, window = {e: 0 for e in range(4)}, Window()
    actor.next_step(FakePuller(stream(versions, {0: True, 1: False, 2: False, 3: False})), Assembler(2), window)
    # the round's 4 episodes x 2 chunks in one optimizer step, less the group whose rewards are equal (advantage 0:
    # no gradient, and counted in the mean it would only shrink the step)
    assert actor.micro_batches == [2, 2] and actor.steps == 1 and window.zero_advantage == 4
    assert sorted(a for _, _, a in actor.reached_loss) == pytest.approx([-1, -1, 1, 1], abs=1e-5)


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("normalize", [True, False])
def test_ppo_trains_each_micro_batch_on_advantages_normalised_over_it(tmp_path, normalize):
    """PPO, asynchronous, a zero critic: one success and one failure of two chunks each. GAE gives the success
    (gamma * lambda, 1) and the failure (0, 0); normalised over the micro-batch (rl.normalize_advantages) the failure
    weighs against the success, where unnormalised it carries no signal at all."""
    from embodyhpc.rl.critic import ValueHead

    actor = bare_actor(version=0, max_staleness=1, asynchronous=True, batch=4)
    actor.rl.micro_batch_size, actor.rl.algorithm, actor.rl.normalize_advantages = 4, "ppo", normalize
    rl = SimpleNamespace(train_seeds=[0], group_size=2, value_lr=1e-3, gamma=0.99, gae_lambda=0.95, clip_eps=0.2)
    actor.critic = ValueHead(SimpleNamespace(rl=rl, eval=SimpleNamespace(tasks=["t"]),
                                             model=SimpleNamespace(state_key="observation.state")),
                             lambda state: state, 2, torch.device("cpu"), tmp_path)
    window = Window()
    actor.next_step(FakePuller(stream({0: 0, 1: 0}, {0: True, 1: False})), Assembler(1), window)
    decay = 0.99 * 0.95
    raw = [decay, 1.0, 0.0, 0.0]  # episode 0's chunks, then episode 1's
    if normalize:
        mean = sum(raw) / 4
        std = (sum((a - mean) ** 2 for a in raw) / 4) ** 0.5
        expected = [(a - mean) / std for a in raw]
    else:
        expected = raw
    assert [a for _, _, a in actor.reached_loss] == pytest.approx(expected, abs=1e-5) and actor.steps == 1


@pytest.mark.usefixtures("one_rank")
def test_a_silent_rollout_worker_ends_the_actor_within_its_bound():
    actor = bare_actor(version=0, max_staleness=1, asynchronous=True, batch=4)
    puller = Puller(Codec(b"k" * 32, sender="actor-0"), hwm=4, timeout_s=0.5)
    raised: list[BaseException] = []

    def collect():
        try:
            actor._collect(puller, Assembler(2), [], Window())
        except BaseException as exc:  # noqa: BLE001 - what the actor role ends with
            raised.append(exc)

    thread = threading.Thread(target=collect, daemon=True)  # a hang fails the test, it does not hang it
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive(), "the actor still waits for a rollout worker that never sends"
    assert len(raised) == 1 and isinstance(raised[0], PeerTimeout)
    assert "rollout workers sent nothing for 0.5 s" in str(raised[0])
    puller.close()


def models(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # a frozen part: never sent
    return model


def test_weights_equal_on_every_rollout_worker_after_a_sync_and_only_trainable_ones_are_sent():
    port, received = free_port(), {}
    actor, rollouts = models(0), [models(1), models(2)]
    frozen_before = [m[0].weight.clone() for m in rollouts]

    def receive(rank):  # a rollout worker as pipeline._rollout sets it up, then its sync wait (rollout.py)
        group = standalone_group("127.0.0.1", port, rank, 3, 20.0)
        receiver = WeightReceiver(rollouts[rank - 1], group, 0, timeout_s=20.0).start()
        worker = RolloutWorker(rollouts[rank - 1], None, None, None, receiver, settings)
        received[rank] = worker._wait_newer(heartbeat=lambda: None)

    settings = RolloutSettings(rank=0, slots=(), plan=None, sync=True, iterations=10, denoise_steps=1,
                               noise_level=0.5, peer_timeout_s=20.0, seed=0)
    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    sender = WeightSender(standalone_group("127.0.0.1", port, 0, 3, 20.0), 0, timeout_s=20.0)
    trainable = trainable_state(actor)
    sender.send(trainable, version=7)
    for t in threads:
        t.join(20.0)
    sender.close()
    assert received == {1: 7, 2: 7}
    assert sender.bytes_sent == 4 * sum(p.numel() for p in trainable.values())
    assert set(trainable) == {"0.bias", "1.weight", "1.bias"}
    for model, frozen in zip(rollouts, frozen_before, strict=True):
        for name, p in model.named_parameters():
            if name in trainable:
                assert torch.equal(p, dict(actor.named_parameters())[name])
        assert torch.equal(model[0].weight, frozen)  # not resent, not touched


@pytest.mark.usefixtures("one_rank")
def test_a_stop_signal_ends_the_wait_for_samples():
    """Preemption while rank 0 waits for samples (a slow round can outlast the signal's warning): _collect returns
    the signal's name at once, and the actor saves the version it has."""
    import signal

    from embodyhpc.train.preempt import StopSignal

    actor = bare_actor(version=2, max_staleness=1, asynchronous=True, batch=4)
    actor.rl.peer_timeout_s = 2.0  # without the stop check it would end in PeerTimeout after 2 s
    stop = StopSignal()
    stop.request(signal.SIGUSR2)
    assert actor._collect(FakePuller([]), Assembler(2), [], Window(), stop) == "SIGUSR2"


ISSUE_METRICS = ("env/success_once", "env/return", "env/episode_length", "rl/staleness_mean", "rl/staleness_max",
                 "rl/rejected_stale_fraction", "time/env_s", "time/rollout_s", "time/push_wait_s",
                 "rl/env_steps_per_s", "rl/samples_per_s")


@pytest.mark.usefixtures("one_rank")
def test_a_version_logs_the_issue_metrics_with_the_times_the_roles_reported():
    """What one version hands its sinks (MLflow): issue 31's metrics, the per-role times summed from the fields the
    rollout and env workers sent (inference, the rollouts' wait on the actor's full queue, env stepping)."""
    actor = bare_actor(version=0, max_staleness=1, asynchronous=False, batch=4)
    written = []
    actor.sinks = [SimpleNamespace(write=lambda step, metrics: written.append((step, metrics)))]
    messages = []
    for episode in range(4):
        for chunk in range(2):
            message = sample_message(sample(episode, chunk, 0))
            message.fields.update(infer_s=0.5, push_wait_s=0.25 * episode)
            messages.append(message)
        message = episode_end_message(end(episode, episode in (0, 3)))
        message.fields.update(env_s=2.0)
        messages.append(message)
    assembler, window = Assembler(2), Window()
    actor.next_step(FakePuller(messages), assembler, window)
    actor._log(1, window, assembler)
    ((step, metrics),) = written
    assert step == 1 and all(key in metrics for key in ISSUE_METRICS), sorted(set(ISSUE_METRICS) - set(metrics))
    assert metrics["time/push_wait_s"] == pytest.approx(2 * 0.25 * (0 + 1 + 2 + 3))
    assert metrics["time/rollout_s"] == pytest.approx(8 * 0.5) and metrics["time/env_s"] == pytest.approx(4 * 2.0)
    assert metrics["env/success_once"] == 0.5 and metrics["env/episode_length"] == 3.0

