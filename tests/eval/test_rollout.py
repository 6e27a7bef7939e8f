"""run_episode's accounting on a scripted line world; run_shard's JSONL, videos and atomicity; a MetaWorld shard."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import require

os.environ.setdefault("MUJOCO_GL", "egl")

from embodyhpc.eval.aggregate import aggregate, load_records  # noqa: E402
from embodyhpc.eval.rollout import run_episode, run_shard  # noqa: E402
from embodyhpc.eval.shards import Episode, all_episodes, plan_shards  # noqa: E402
from embodyhpc.eval.suites import episode_seed  # noqa: E402
from tests.eval.fake_suite import ConstantPolicy, LineSuite  # noqa: E402

pytestmark = pytest.mark.sim  # steps a simulator


def decode(path):
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        codec, pix_fmt = stream.codec_context.name, stream.codec_context.pix_fmt
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return codec, pix_fmt, frames


def rollout(policy, seed=0, episode=0, **kwargs):
    suite = LineSuite(["walk"], limit=20)
    env = suite.make_env("walk", seed, episode)
    return run_episode(env, policy, Episode("walk", seed, episode), **{"max_steps": 20, **kwargs})


def test_run_episode_accounting():
    forward = ConstantPolicy(1.0)
    record = rollout(forward)  # starts at -1: positions 0, 1, 2, 3 -> success at step 4
    assert {k: record[k] for k in ("success", "length", "success_step", "return")} == {
        "success": True, "length": 4, "success_step": 4, "return": 4.0}
    assert forward.resets == [("walk", episode_seed("walk", 0, 0))]
    assert record["wall_s"] >= 0 and (record["task"], record["seed"], record["episode"]) == ("walk", 0, 0)

    record = rollout(ConstantPolicy(1.0), stop_on_success=False)  # runs on to the env's done
    assert (record["success"], record["length"], record["success_step"], record["return"]) == (True, 20, 4, 20.0)
    record = rollout(ConstantPolicy(1.0), episode=2)  # starts at -3: success at step 6
    assert (record["length"], record["success_step"]) == (6, 6)
    record = rollout(ConstantPolicy(-1.0))
    assert (record["success"], record["length"], record["success_step"], record["return"]) == (False, 20, None, 0.0)
    assert rollout(ConstantPolicy(1.0), max_steps=2)["length"] == 2
    with pytest.raises(ValueError):
        rollout(ConstantPolicy(1.0), max_steps=0)


def test_cameras_are_rendered_for_the_observations_the_policy_reads():
    """A receding-horizon policy (3 actions per chunk) reads observations 0, 3, 6 ...: the env renders those only."""
    told = []

    class SparseEnv(LineSuite(["walk"]).make_env("walk", 0, 0).__class__):
        def observe_images(self, on):
            told.append(on)

    class Chunked(ConstantPolicy):
        def act(self, obs):
            self.calls = getattr(self, "calls", 0) + 1
            return super().act(obs)

        def reads_next_observation(self):
            return self.calls % 3 == 0

    env = SparseEnv("walk", 0, 0, 20, 16)
    run_episode(env, Chunked(-1.0), Episode("walk", 0, 0), max_steps=7)
    # before step t the env learns whether the observation step t returns is read (steps 3 and 6 re-plan)
    assert told == [False, False, True, False, False, True, False]
    told.clear()
    run_episode(SparseEnv("walk", 0, 0, 20, 16), ConstantPolicy(-1.0), Episode("walk", 0, 0), max_steps=3)
    assert told == [True, True, True]  # a policy that does not say reads every observation


def test_run_shard_writes_complete_jsonl_and_videos(tmp_path):
    suite = LineSuite(["walk", "run"], image_size=16)
    episodes = plan_shards(["walk", "run"], [0, 1], 3, 2)[0]
    out = tmp_path / "eval" / "shard-0000.jsonl"
    summary = run_shard(suite, episodes, ConstantPolicy(1.0), out, policy_name="trained",
                        video_dir=tmp_path / "videos", videos_per_task=2, extra={"shard": 0, "step": 1000})
    assert sorted(p.name for p in out.parent.iterdir()) == ["shard-0000.jsonl"]  # no .tmp left
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(Episode(r["task"], r["seed"], r["episode"]) for r in records) == sorted(episodes)
    tasks_in_order = [r["task"] for r in records]
    assert tasks_in_order == sorted(tasks_in_order, key=tasks_in_order.index)  # grouped by task
    assert all(r["policy"] == "trained" and r["shard"] == 0 and r["step"] == 1000 for r in records)
    assert summary.episodes == len(episodes) and summary.steps == sum(r["length"] for r in records)
    assert summary.successes == sum(r["success"] for r in records) and summary.episodes_per_s > 0
    assert all(env.closed for env in suite.opened)

    with_video = [r for r in records if r["video"]]
    assert sorted(summary.videos) == sorted(tmp_path / "videos" / r["video"] for r in with_video)
    for task in ("walk", "run"):  # at most 2 (videos_per_task) of each outcome per task, named by outcome
        for outcome in (True, False):
            kept = [r for r in with_video if r["task"] == task and r["success"] == outcome]
            done = [r for r in records if r["task"] == task and r["success"] == outcome]
            assert len(kept) == min(2, len(done))
            assert all(r["video"] == f"trained/{task}/{'success' if outcome else 'failure'}-seed{r['seed']}-"
                                     f"ep{r['episode']:04d}.mp4" for r in kept)
    files = sorted(p.relative_to(tmp_path / "videos").as_posix() for p in (tmp_path / "videos").rglob("*.mp4"))
    assert files == sorted(r["video"] for r in with_video)  # films of outcomes already covered are deleted
    for r in with_video:
        codec, pix_fmt, frames = decode(tmp_path / "videos" / r["video"])
        assert (codec, pix_fmt) == ("h264", "yuv420p")
        assert len(frames) == r["length"] + 1 and frames[0].shape == (16, 16, 3)  # the initial state + every step
    assert not list((tmp_path / "videos").rglob("*.tmp.mp4"))

    report = aggregate(load_records(out.parent), episodes)
    assert report.complete and report.policies["trained"].overall.recorded == len(episodes)


def test_extra_fields_cannot_overwrite_the_record(tmp_path):
    with pytest.raises(ValueError, match="success"):
        run_shard(LineSuite(["walk"]), all_episodes(["walk"], [0], 1), ConstantPolicy(1.0), tmp_path / "s.jsonl",
                  policy_name="p", extra={"success": True})


def test_a_failing_shard_leaves_no_shard_file(tmp_path):
    suite = LineSuite(["walk"], image_size=16)
    out = tmp_path / "shard-0001.jsonl"
    with pytest.raises(RuntimeError, match="policy crashed"):
        run_shard(suite, all_episodes(["walk"], [0], 4), ConstantPolicy(1.0, fail_on_episode=2), out,
                  policy_name="trained", video_dir=tmp_path / "videos", videos_per_task=4)
    assert not out.exists()
    assert all(env.closed for env in suite.opened)
    assert not list((tmp_path / "videos").rglob("*.tmp.mp4"))  # the interrupted video is removed
    assert len(list((tmp_path / "videos").rglob("*.mp4"))) == 2  # the finished ones stay


def test_metaworld_expert_shard_with_video(tmp_path):
    require("metaworld", "sim")
    from embodyhpc.eval.policies import ExpertPolicy
    from embodyhpc.eval.suites import make_suite

    episodes = all_episodes(["reach-v3"], [0], 2)
    with make_suite("metaworld", ["reach-v3"], video_size=64) as suite:
        summary = run_shard(suite, episodes, ExpertPolicy(suite), tmp_path / "shard.jsonl", policy_name="expert",
                            video_dir=tmp_path / "videos", videos_per_task=1)
    records = load_records(tmp_path / "shard.jsonl")
    assert len(records) == 2 and summary.successes == sum(r["success"] for r in records) >= 1
    (video,) = summary.videos
    codec, pix_fmt, frames = decode(video)
    assert (codec, pix_fmt) == ("h264", "yuv420p")
    assert len(frames) == records[0]["length"] + 1 and frames[0].shape == (64, 64, 3)
    assert frames[0].std() > 5
