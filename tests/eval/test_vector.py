"""A shard's episodes N at a time (embodyhpc.eval.vector) against the sequential shard (embodyhpc.eval.rollout):
the same initial states and the same actions give the same records, on a scripted line world, on MetaWorld, with
the tiny pi0.5 batched over envs, and (slow) on LIBERO."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers import require

os.environ.setdefault("MUJOCO_GL", "egl")

from embodyhpc.eval.policies import ExpertPolicy, RandomPolicy  # noqa: E402
from embodyhpc.eval.rollout import run_shard  # noqa: E402
from embodyhpc.eval.shards import Episode  # noqa: E402
from embodyhpc.eval.suites import make_suite  # noqa: E402
from embodyhpc.eval.vector import PerEnvPolicies, SuiteSpec, run_shard_vector  # noqa: E402
from tests.eval.fake_suite import LineSuite  # noqa: E402

pytestmark = pytest.mark.sim  # steps a simulator

OUTCOME = ("task", "seed", "episode", "success", "return", "length", "success_step", "video")


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def outcomes(path):
    return [{k: r[k] for k in OUTCOME} for r in records(path)]


def both(tmp_path, spec, episodes, make_policy, num_envs, **kwargs):
    """(sequential records, vectorised records, vector summary) of the same episodes."""
    suite = spec.make()
    try:
        run_shard(suite, episodes, make_policy(suite), tmp_path / "seq.jsonl", policy_name="p",
                  video_dir=tmp_path / "seq-videos", **kwargs)
    finally:
        suite.close()
    parent_suite = spec.make()  # reference policies read action bounds / experts in the parent
    try:
        summary = run_shard_vector(spec, episodes, PerEnvPolicies(lambda: make_policy(parent_suite), num_envs),
                                   tmp_path / "vec.jsonl", policy_name="p", num_envs=num_envs,
                                   video_dir=tmp_path / "vec-videos", **kwargs)
    finally:
        parent_suite.close()
    return outcomes(tmp_path / "seq.jsonl"), outcomes(tmp_path / "vec.jsonl"), summary


def test_line_world_n_envs_give_the_records_of_n_sequential_episodes(tmp_path):
    spec = SuiteSpec("line", LineSuite, ("walk", "run"), options={"limit": 12})
    episodes = [Episode(task, 0, e) for e in range(4) for task in ("walk", "run")]
    seq, vec, summary = both(tmp_path, spec, episodes, RandomPolicy, 3, videos_per_task=1)
    assert vec == seq
    assert [(r["task"], r["episode"]) for r in vec] == [("walk", e) for e in range(4)] + [("run", e) for e in range(4)]
    assert len({(r["success"], r["length"]) for r in vec}) > 1  # episodes differ: the comparison means something
    assert summary.num_envs == 3 and summary.episodes == 8 and summary.steps == sum(r["length"] for r in vec)
    assert summary.successes == sum(r["success"] for r in vec)
    # videos: per task at most one success and one failure, named by the outcome of the episode they show (which
    # episode is filmed depends on the order envs finish in, so the names, not the episodes, are compared)
    for task in ("walk", "run"):
        names = sorted(p.name for p in (tmp_path / "vec-videos" / "p" / task).iterdir())
        outcome = {f"seed0-ep{r['episode']:04d}.mp4": r["success"] for r in vec if r["task"] == task}
        assert names and len({n.split("-", 1)[0] for n in names}) == len(names) <= 2, names
        for name in names:
            kind, episode = name.split("-", 1)
            assert kind == ("success" if outcome[episode] else "failure"), (name, outcome)
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_metaworld_expert_and_random_rows_are_the_same_with_three_envs(tmp_path):
    require("metaworld", "sim")
    spec = SuiteSpec.of("metaworld", ["reach-v3", "button-press-topdown-v3"])
    episodes = [Episode(task, 100, e) for task in ("reach-v3", "button-press-topdown-v3") for e in range(3)]
    for name, make in (("expert", ExpertPolicy), ("random", RandomPolicy)):
        seq, vec, _ = both(tmp_path / name, spec, episodes, make, 3, max_steps=60, videos_per_task=0)
        assert vec == seq, name
        if name == "expert":
            assert any(r["success"] for r in vec) and any(r["length"] > 1 for r in vec)


@pytest.mark.slow
def test_the_trained_policy_serves_every_env_in_one_batch_and_acts_as_it_does_alone(tmp_path):
    """Tiny pi0.5 (random weights) on MetaWorld with a camera: chunks of several envs come from one forward, and
    each episode gets the actions it gets on its own (its noise from its own generator)."""
    require("metaworld", "sim")
    import torch

    from embodyhpc.data.normalize import StateNormalizer
    from embodyhpc.models import build_model
    from embodyhpc.models.pi05.inference import Pi05Runner
    from embodyhpc.validation import load_recipe

    config = load_recipe("demo_metaworld_cpu").config
    torch.manual_seed(0)
    model = build_model(config.model, config.precision).float()

    def policy():
        return Pi05Runner(model, config, normalizer=StateNormalizer(config.model.state_key, "none"),
                             execute_steps=3, denoise_steps=2, num_action_dims=4)

    spec = SuiteSpec.of("metaworld", ["reach-v3"], cameras=["corner"], image_size=32)
    episodes = [Episode("reach-v3", 100, e) for e in range(3)]
    alone = policy()
    with spec.make() as suite:
        run_shard(suite, episodes, alone, tmp_path / "seq.jsonl", policy_name="trained", max_steps=7)
    batched = policy()
    run_shard_vector(spec, episodes, batched, tmp_path / "vec.jsonl", policy_name="trained", num_envs=3,
                     max_steps=7)
    seq, vec = outcomes(tmp_path / "seq.jsonl"), outcomes(tmp_path / "vec.jsonl")
    assert [{k: r[k] for k in OUTCOME if k != "return"} for r in vec] == \
        [{k: r[k] for k in OUTCOME if k != "return"} for r in seq]
    assert [r["return"] for r in vec] == pytest.approx([r["return"] for r in seq], rel=1e-4)
    assert alone.chunks_predicted == batched.chunks_predicted == 3 * 3  # ceil(7 / 3) chunks per episode
    assert alone.batches_predicted == 9 and batched.batches_predicted == 3  # all three envs in every batch


def test_a_failing_env_names_its_episode_and_the_workers_are_reaped(tmp_path):
    require("metaworld", "sim")
    import multiprocessing

    spec = SuiteSpec.of("metaworld", ["reach-v3"])
    episodes = [Episode("reach-v3", 100, 0), Episode("push-v3", 100, 0)]  # push-v3: not a task of this suite
    failed = r"env worker 1 failed while starting .*push-v3.*ValueError: task 'push-v3' is not in this suite"
    with make_suite("metaworld", ["reach-v3", "push-v3"]) as suite, pytest.raises(RuntimeError, match=failed):
        run_shard_vector(spec, episodes, PerEnvPolicies(lambda: RandomPolicy(suite), 2), tmp_path / "vec.jsonl",
                         policy_name="random", num_envs=2, max_steps=5)
    assert not (tmp_path / "vec.jsonl").exists()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("embodyhpc-env-")]


@pytest.mark.slow
def test_libero_pair_of_short_episodes_is_the_same_with_two_envs(tmp_path):
    require("libero", "libero")
    spec = SuiteSpec.of("libero", ["libero_spatial/0"], render_quality="fast")
    episodes = [Episode("libero_spatial/0", 0, 0), Episode("libero_spatial/0", 0, 1)]
    seq, vec, _ = both(tmp_path, spec, episodes, RandomPolicy, 2, max_steps=5, videos_per_task=0)
    assert vec == seq
    assert [r["length"] for r in vec] == [5, 5] and seq[0]["return"] == vec[0]["return"]


def test_suite_spec_builds_what_make_suite_builds():
    spec = SuiteSpec.of("metaworld", ["MT10"], cameras=["corner"], image_size=32, video_size=64)
    with spec.make() as suite, make_suite("metaworld", ["MT10"], cameras=["corner"], image_size=32,
                                           video_size=64) as named:
        assert (suite.tasks, suite.cameras, suite.image_size, suite.video_size) == \
            (named.tasks, named.cameras, named.image_size, named.video_size)
    assert np.all([isinstance(t, str) for t in spec.tasks])
