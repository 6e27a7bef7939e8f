"""Batched evaluation out of lockstep: envs finish at different steps, so the active set shrinks and an env's batch
position stops being its id. Every env's trajectory (states, actions, rewards, successes, length) must be the one
the same episode gives run alone, with a policy whose action depends on that env's own history: a per-episode
running sum (PerEnvPolicies, the reference rows) and receding-horizon chunks queued per env (models/receding.py,
the trained row). The reference is this file's own one-env loop, not the code under test."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embodyhpc.eval.shards import Episode
from embodyhpc.eval.suites import episode_seed
from embodyhpc.eval.vector import PerEnvPolicies, SuiteSpec, run_shard_vector
from embodyhpc.models.receding import RecedingHorizonRunner
from tests.eval.ragged_suite import LedgerSuite

pytestmark = pytest.mark.sim  # steps a (scripted) simulator in worker processes

TASK = "ledger"
LIMIT = 9  # the suite's step limit
# episode e runs LENGTHS[e] steps at most (the env's done); with goal 1.0 and the policies below the six episodes
# end by done after 1, 1 and 2 steps, by success and done together, by success on the last allowed step, and by
# the step limit without success (asserted below on the reference, so the comparison means something). In this
# plan order, with three envs: env 0 runs episodes 3 then 0, env 1 runs 2 then 4, env 2 runs 1 then 5; env 0 is
# done after step 4, so envs 1 and 2 then sit at batch positions 0 and 1 (env 1 alone at 0 for the last step),
# their receding-horizon chunks one step out of phase
OPTIONS = {"lengths": (1, 1, 2, 3, 12, 12), "goal": 1.0, "limit": LIMIT}
EPISODES = [Episode(TASK, 0, e) for e in (3, 2, 1, 5, 4, 0)]


class HistoryPolicy:
    """One episode's state: its action encodes the running sum of the positions its env showed it, and its seed."""

    def reset(self, task, seed):
        self.seed, self.total, self.steps = seed, 0.0, 0

    def act(self, obs):
        self.total += float(obs["observation.state"][0])
        self.steps += 1
        return np.array([0.3 + 0.1 * np.sin(self.total) + 1e-3 * (self.seed % 17)], dtype=np.float32)

    def episode_info(self):
        return {"seed": self.seed, "steps": self.steps, "total": self.total}


class WatchedPolicies(PerEnvPolicies):
    """PerEnvPolicies, remembering which envs each batch served."""

    batches: list[list[int]]

    def act_batch(self, observations, envs):
        self.batches = [*getattr(self, "batches", []), list(envs)]
        return super().act_batch(observations, envs)


class ChunkModel(torch.nn.Module):
    """A stand-in for a flow-matching model's `sample_actions`: chunk step k of a sample is 0.25 + 0.05 k + 0.1
    tanh(x) + (camera value - 100) / 400 + 0.01 noise, so a chunk depends on the observation it was predicted from
    (its position and its camera image) and on its env's noise."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))

    def sample_actions(self, batch, num_steps, noise):
        steps = torch.arange(noise.shape[1], dtype=torch.float32)[None, :, None]
        x, camera = batch[:, None, None, 0], batch[:, None, None, 1]
        return 0.25 + 0.05 * steps + 0.1 * torch.tanh(x) + (camera - 100) / 400 + 0.01 * noise


class ChunkRunner(RecedingHorizonRunner):
    """The shared receding-horizon runner over ChunkModel; a chunk needs its observation's camera image (rendered
    only when the runner said it reads that observation)."""

    def __init__(self):
        config = SimpleNamespace(model=SimpleNamespace(action_horizon=5, action_dim=2))
        super().__init__(ChunkModel(), config, normalizer=None, execute_steps=3, denoise_steps=1, num_action_dims=1)
        self.batches: list[list[int]] = []

    def act_batch(self, observations, envs):
        self.batches.append(list(envs))
        return super().act_batch(observations, envs)

    def predict_chunks(self, observations, envs):
        rows = [[float(obs["observation.state"][0]), float(obs["observation.images.cam"].mean())]
                for obs in observations]
        return self.sample_chunks(torch.tensor(rows), envs)


def alone(episode, policy_reset, act, log_dir):
    """The episode on its own env, one step at a time (stop at success, done or the limit): its env's log."""
    env = LedgerSuite([TASK], **OPTIONS, log_dir=str(log_dir)).make_env(episode.task, episode.seed, episode.episode)
    policy_reset(episode.task, episode_seed(episode.task, episode.seed, episode.episode))
    obs = env.reset()
    for _ in range(LIMIT):
        obs, _, success, done = env.step(act(obs))
        if success or done:
            break
    env.close()
    return json.loads((log_dir / f"{TASK}-0-{episode.episode}.json").read_text())


def logs(log_dir):
    return {e.episode: json.loads((log_dir / f"{TASK}-0-{e.episode}.json").read_text()) for e in EPISODES}


def check_against_alone(vector_logs, reference, out):
    """Each env's log and each record against the episode run alone."""
    records = {r["episode"]: r for r in map(json.loads, out.read_text().splitlines())}
    for e, log in reference.items():
        assert vector_logs[e] == log, f"episode {e}: its env's trajectory differs from the episode run alone"
        first = next((i + 1 for i, s in enumerate(log["successes"]) if s), None)
        assert (records[e]["length"], records[e]["success"], records[e]["success_step"]) == \
            (len(log["actions"]), first is not None, first), f"episode {e}: (length, success, success_step)"
        assert records[e]["return"] == pytest.approx(sum(log["rewards"]), abs=1e-9)


def test_envs_finishing_at_different_steps_keep_their_own_per_env_policies(tmp_path):
    (tmp_path / "alone").mkdir()
    (tmp_path / "vector").mkdir()
    reference, infos = {}, {}
    for episode in EPISODES:
        policy = HistoryPolicy()
        reference[episode.episode] = alone(episode, policy.reset, policy.act, tmp_path / "alone")
        infos[episode.episode] = policy.episode_info()
    ends = [(len(log["actions"]), log["successes"][-1], log["dones"][-1]) for _, log in sorted(reference.items())]
    assert ends == [(1, False, True), (1, False, True), (2, False, True), (3, True, True), (LIMIT, True, False),
                    (LIMIT, False, False)]

    spec = SuiteSpec("ledger", LedgerSuite, (TASK,), options={**OPTIONS, "log_dir": str(tmp_path / "vector")})
    policies = WatchedPolicies(HistoryPolicy, 3)
    out = tmp_path / "vec.jsonl"
    run_shard_vector(spec, EPISODES, policies, out, policy_name="history", num_envs=3)
    check_against_alone(logs(tmp_path / "vector"), reference, out)
    # the run left lockstep: envs 1 and 2 were served at batch positions 0 and 1 once env 0 had nothing left
    assert policies.batches.count([1, 2]) >= 3 and [1] in policies.batches
    records = {r["episode"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert {e: records[e]["replay"] for e in infos} == infos  # each env's policy reported its own episode


def test_receding_horizon_chunks_stay_with_their_env_when_others_finish(tmp_path):
    (tmp_path / "alone").mkdir()
    (tmp_path / "vector").mkdir()
    solo = ChunkRunner()
    reference = {e.episode: alone(e, solo.reset, solo.act, tmp_path / "alone") for e in EPISODES}
    lengths = [len(log["actions"]) for log in reference.values()]
    assert len(set(lengths)) >= 3 and any(len(log["actions"]) == LIMIT and log["successes"][-1]
                                          for log in reference.values())  # one succeeds on its last allowed step

    spec = SuiteSpec("ledger", LedgerSuite, (TASK,), options={**OPTIONS, "log_dir": str(tmp_path / "vector")})
    batched = ChunkRunner()
    out = tmp_path / "vec.jsonl"
    run_shard_vector(spec, EPISODES, batched, out, policy_name="trained", num_envs=3)
    check_against_alone(logs(tmp_path / "vector"), reference, out)
    # envs 1 and 2 went on at batch positions 0 and 1 after env 0's last episode, in the middle of their chunks
    assert batched.batches.count([1, 2]) >= 3 and [1] in batched.batches
    assert batched.chunks_predicted == solo.chunks_predicted  # the same re-plans, batched
    assert batched.batches_predicted < solo.batches_predicted

