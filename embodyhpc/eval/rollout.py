"""Roll policies out in a suite: one episode (`run_episode`), or one shard of the evaluation to JSONL (`run_shard`).

    from embodyhpc.eval.rollout import run_shard
    summary = run_shard(suite, shard_episodes, policy, run_dir / "eval/shard-0003.jsonl", policy_name="trained",
                        video_dir=run_dir / "eval/videos")

One JSON record per episode:

    {"policy": "trained", "task": "reach-v3", "seed": 0, "episode": 3, "success": true, "return": 412.7,
     "length": 57, "success_step": 57, "wall_s": 0.41, "video": "trained/reach-v3/success-seed0-ep0003.mp4" or null,
     ...}

success: any step reported success. With stop_on_success (the default) the episode ends at that step, as the
demos do; length counts the steps taken and success_step is the first successful one (1-based, null if none).
The shard file is written as `<name>.tmp` and renamed when every episode is in: a shard file exists only when
complete, so the report can tell a missing shard from a short one.

Videos (H.264, yuv420p, plays in browsers and MLflow): per task, up to `videos_per_task` successes AND as many
failures (`VideoKeeper`), named by outcome: `<policy>/<task>/success-seed0-ep0003.mp4`, `failure-...`. An episode is
filmed while its task still lacks a video of either outcome (at most RECORDINGS_PER_KEPT x videos_per_task tries
per task and shard); a film whose outcome is already covered is deleted. Frames from `env.render()` (the suite's
video camera), the initial state and one per step, at the simulator's control rate.

Cameras cost most of an episode on CPU. A policy that says whether its next `act` reads the observation
(`reads_next_observation()`, e.g. between re-plans of a receding horizon) lets a suite that can skip rendering
(`env.observe_images(on)`) render cameras only for the observations the policy reads.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embodyhpc.atomic import write_jsonl_atomic
from embodyhpc.eval.policies import Policy
from embodyhpc.eval.shards import Episode
from embodyhpc.eval.suites import EvalEnv, Obs, Suite, episode_seed

RECORD_FIELDS = frozenset({"policy", "task", "seed", "episode", "success", "return", "length", "success_step",
                           "wall_s", "video"})
VIDEO_GOP = 16  # keyframe interval of rollout videos: small files, seeking is rare


class EpisodeVideo:
    """An mp4 written frame by frame to `<path>.tmp.mp4`, renamed to `path` by `close()` (removed by `abort()`)."""

    def __init__(self, path: Path, fps: int) -> None:
        self.path, self.fps = Path(path), fps
        self._tmp = self.path.with_name(self.path.stem + ".tmp.mp4")
        self._writer: Any = None
        self.num_frames = 0

    def write(self, frame: np.ndarray) -> None:
        if self._writer is None:
            from embodyhpc.data.video_encode import VideoFileWriter, VideoOptions

            height, width = frame.shape[:2]
            if height % 2 or width % 2:
                raise ValueError(f"video frames need an even width and height for yuv420p, got {width}x{height}")
            self._writer = VideoFileWriter(self._tmp, width, height, self.fps, VideoOptions(gop_size=VIDEO_GOP))
        self._writer.write(np.asarray(frame, dtype=np.uint8)[None])
        self.num_frames += 1

    def close(self) -> Path | None:
        if self._writer is None:
            return None
        self._writer.close()
        self._writer = None
        os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            finally:
                self._writer = None
                self._tmp.unlink(missing_ok=True)


def run_episode(env: EvalEnv, policy: Policy, episode: Episode, *, max_steps: int, video: Path | None = None,
                stop_on_success: bool = True,
                on_step: Callable[[Obs, np.ndarray, float, bool], None] | None = None) -> dict[str, Any]:
    """Roll `policy` out from `env.reset()` for at most max_steps steps; the episode's record (see module doc).
    on_step(observation, action, reward, success) sees every step (the observation the action was taken on, with
    its cameras always rendered): what recording a dataset needs."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    start = time.perf_counter()
    recorder = EpisodeVideo(video, env.fps) if video is not None else None
    total, length, success_step = 0.0, 0, None
    try:
        policy.reset(episode.task, episode_seed(episode.task, episode.seed, episode.episode))
        obs = env.reset()
        if recorder:
            recorder.write(env.render())
        observe = getattr(env, "observe_images", None)  # suites that can skip rendering cameras (LIBERO)
        reads = getattr(policy, "reads_next_observation", None)
        for _ in range(max_steps):
            action = policy.act(obs)
            if observe is not None:
                observe(reads is None or on_step is not None or reads())
            before = obs
            obs, reward, success, done = env.step(action)
            if on_step is not None:
                on_step(before, action, reward, success)
            length += 1
            total += reward
            if recorder:
                recorder.write(env.render())
            if success and success_step is None:
                success_step = length
            if done or (success and stop_on_success):
                break
        if recorder:
            recorder.close()
    except BaseException:
        if recorder:
            recorder.abort()
        raise
    record = episode_record(episode, total=total, length=length, success_step=success_step, start=start)
    info = getattr(policy, "episode_info", None)  # what a reference policy reports of its episode (eval/replay.py)
    if info is not None:
        record["replay"] = info()
    return record


def episode_record(episode: Episode, *, total: float, length: int, success_step: int | None,
                   start: float) -> dict[str, Any]:
    """An episode's record (see module doc) from its accounting; `start` is its perf_counter() start."""
    return {"task": episode.task, "seed": episode.seed, "episode": episode.episode,
            "success": success_step is not None, "return": total, "length": length, "success_step": success_step,
            "wall_s": time.perf_counter() - start}


def shard_record(policy_name: str, episode: Episode, record: Mapping[str, Any], *, video: str | None,
                 extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The line a shard file holds for an episode: its policy, its record, its kept video's name, the extra fields."""
    return {"policy": policy_name, **record, "video": video, **(extra or {})}


@dataclass
class ShardSummary:
    """What `run_shard` wrote and how fast."""

    out: Path
    policy: str
    episodes: int = 0
    successes: int = 0
    steps: int = 0
    wall_s: float = 0.0
    videos: list[Path] = field(default_factory=list)
    num_envs: int = 1
    """Episodes run at once (embodyhpc.eval.vector)."""

    @property
    def episodes_per_s(self) -> float:
        return self.episodes / self.wall_s if self.wall_s else 0.0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.wall_s if self.wall_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "out": str(self.out), "videos": [str(v) for v in self.videos],
                "episodes_per_s": self.episodes_per_s, "steps_per_s": self.steps_per_s}


def video_name(policy_name: str, episode: Episode, outcome: str) -> str:
    """Where an episode's kept video lands under video_dir (also the record's "video" field); outcome is
    "success" or "failure"."""
    return f"{policy_name}/{episode.task}/{outcome}-seed{episode.seed}-ep{episode.episode:04d}.mp4"


RECORDINGS_PER_KEPT = 4
"""An episode is filmed only while its task lacks a video of some outcome, at most this many x videos_per_task
times per task (a policy that never fails does not film every episode looking for a failure)."""


class VideoKeeper:
    """Which episodes of one shard and policy are filmed, and which films are kept under which name."""

    def __init__(self, video_dir: str | os.PathLike | None, policy_name: str, videos_per_task: int) -> None:
        self.video_dir = Path(video_dir) if video_dir is not None else None
        self.policy_name, self.per_task = policy_name, videos_per_task
        self.kept: Counter[tuple[str, bool]] = Counter()
        self.filmed: Counter[str] = Counter()

    def film(self, episode: Episode) -> Path | None:
        """Where to film `episode` (its folder made), or None when its task needs no more films."""
        task = episode.task
        covered = all(self.kept[task, outcome] >= self.per_task for outcome in (True, False))
        if self.video_dir is None or covered or self.filmed[task] >= RECORDINGS_PER_KEPT * self.per_task:
            return None
        self.filmed[task] += 1
        path = self.video_dir / self.policy_name / task / f"filming-seed{episode.seed}-ep{episode.episode:04d}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def keep(self, episode: Episode, film: Path | None, success: bool) -> str | None:
        """The film renamed by outcome (its name under video_dir), or deleted (None) when that outcome of its task
        has its videos already."""
        if film is None or self.video_dir is None:
            return None
        if self.kept[episode.task, success] >= self.per_task or not film.is_file():
            film.unlink(missing_ok=True)
            return None
        self.kept[episode.task, success] += 1
        name = video_name(self.policy_name, episode, "success" if success else "failure")
        film.replace(self.video_dir / name)
        return name


def check_shard_args(videos_per_task: int, extra: Mapping[str, Any] | None) -> None:
    if videos_per_task < 0:
        raise ValueError(f"videos_per_task must be >= 0, got {videos_per_task}")
    clash = sorted(set(extra or ()) & RECORD_FIELDS)
    if clash:
        raise ValueError(f"extra fields {clash} would overwrite the episode record's own fields")


def shard_order(episodes: Sequence[Episode]) -> list[Episode]:
    """Episodes grouped by task in order of first appearance, plan order within a task (the suite keeps a task's
    simulator between its episodes)."""
    first_seen = {task: i for i, task in reversed(list(enumerate(e.task for e in episodes)))}
    return sorted(episodes, key=lambda e: first_seen[e.task])  # stable: plan order within a task


def run_shard(suite: Suite, episodes: Sequence[Episode], policy: Policy, out_jsonl: str | os.PathLike, *,
              policy_name: str, video_dir: str | os.PathLike | None = None, videos_per_task: int = 1,
              max_steps: int | None = None, stop_on_success: bool = True,
              extra: Mapping[str, Any] | None = None) -> ShardSummary:
    """Run `episodes` with `policy` and write one JSON line each to `out_jsonl` (atomically, when all are done).

    Episodes run grouped by task (the suite keeps a task's simulator between its episodes); records carry
    "policy": policy_name and the `extra` fields (e.g. shard index, checkpoint step).
    max_steps: per-episode step limit (default: the suite's limit of each task).
    """
    check_shard_args(videos_per_task, extra)
    out = Path(out_jsonl)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = ShardSummary(out=out, policy=policy_name)
    start = time.perf_counter()
    records = []
    videos = VideoKeeper(video_dir, policy_name, videos_per_task)
    for episode in shard_order(episodes):
        film = videos.film(episode)
        env = suite.make_env(episode.task, episode.seed, episode.episode)
        try:
            limit = max_steps or suite.max_steps(episode.task)
            record = run_episode(env, policy, episode, max_steps=limit, video=film, stop_on_success=stop_on_success)
        finally:
            env.close()
        kept = videos.keep(episode, film, record["success"])
        records.append(shard_record(policy_name, episode, record, video=kept, extra=extra))
        summary.episodes += 1
        summary.successes += int(record["success"])
        summary.steps += record["length"]
        if kept:
            summary.videos.append(Path(video_dir) / kept)
    write_jsonl_atomic(out, records, durable=True)  # a shard file exists only when complete
    summary.wall_s = time.perf_counter() - start
    return summary


__all__ = ["RECORD_FIELDS", "EpisodeVideo", "ShardSummary", "VideoKeeper", "check_shard_args", "episode_record",
           "run_episode", "run_shard", "shard_order", "shard_record", "video_name"]
