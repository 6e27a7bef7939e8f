"""Record a policy's episodes in any evaluation suite as a LeRobot v3.0 dataset.

    from embodyhpc.eval.record import record_episodes
    summary = record_episodes(suite, episodes, policy, "/data/libero-random", max_steps=40)

What `embodyhpc data synth --env SUITE` runs: a suite's scripted expert where it has one, else (for pipeline tests
and convention checks) the random policy. Frame t holds the observation before step t and the action taken there
(LeRobot's convention), `next.reward` and `next.success` after it; the suite's observation keys and shapes become
the features (cameras as videos), so a policy trained on the dataset reads the suite's observations unchanged.
meta/episodes gets success (bool) and env_task, env_seed, env_episode: the episode triple that
`suite.make_env(env_task, env_seed, env_episode)` turns back into the same initial state.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embodyhpc.eval.policies import Policy
from embodyhpc.eval.rollout import run_episode
from embodyhpc.eval.shards import Episode
from embodyhpc.eval.suites import Suite


@dataclass
class RecordSummary:
    root: Path
    num_episodes: int
    num_frames: int
    successes: int
    wall_s: float


def dataset_features(suite: Suite, task: str) -> dict[str, dict[str, Any]]:
    """The LeRobot features of `suite`'s observations of `task`, its action, reward and success."""
    features: dict[str, dict[str, Any]] = {}
    for key, spec in suite.features(task).items():
        if key.startswith("observation.images."):
            features[key] = {"dtype": "video", "shape": list(spec["shape"])}
        else:
            features[key] = {"dtype": spec["dtype"], "shape": list(spec["shape"])}
    low, _ = suite.action_bounds(task)
    features["action"] = {"dtype": "float32", "shape": [int(np.asarray(low).shape[0])]}
    features["next.reward"] = {"dtype": "float32", "shape": [1]}
    features["next.success"] = {"dtype": "bool", "shape": [1]}
    return features


def record_episodes(suite: Suite, episodes: Sequence[Episode], policy: Policy, out: str | os.PathLike, *,
                    max_steps: int | None = None, overwrite: bool = False, keep_failed: bool = True,
                    stop_on_success: bool = True) -> RecordSummary:
    """Roll `policy` out on `episodes` and write them to a new dataset at `out` (see the module doc)."""
    from embodyhpc.data.writer import LeRobotWriter

    if not episodes:
        raise ValueError("no episodes to record")
    features = dataset_features(suite, episodes[0].task)
    for task in {e.task for e in episodes}:
        if dataset_features(suite, task) != features:
            raise ValueError(f"task {task!r} observes other features than {episodes[0].task!r}: record them apart")
    start = time.perf_counter()
    first = suite.make_env(episodes[0].task, episodes[0].seed, episodes[0].episode)
    fps = first.fps
    first.close()
    observed = [k for k in features if k not in ("action", "next.reward", "next.success")]
    recorded = successes = frames_total = 0
    with LeRobotWriter(out, fps=fps, features=features, overwrite=overwrite) as writer:
        for episode in episodes:
            frames: dict[str, list[Any]] = {k: [] for k in features}

            def keep(obs: Any, action: np.ndarray, reward: float, step_success: bool, frames=frames) -> None:
                for key in observed:
                    frames[key].append(obs[key])
                frames["action"].append(np.asarray(action, dtype=np.float32))
                frames["next.reward"].append(reward)
                frames["next.success"].append(step_success)

            env = suite.make_env(episode.task, episode.seed, episode.episode)
            try:
                success = run_episode(env, policy, episode, max_steps=max_steps or suite.max_steps(episode.task),
                                      stop_on_success=stop_on_success, on_step=keep)["success"]
            finally:
                env.close()
            if not (success or keep_failed):
                continue
            writer.add_episode({k: np.stack(v) if k in observed or k == "action" else np.asarray(v)
                                for k, v in frames.items()}, task=suite.instruction(episode.task),
                               extra={"success": success, "env_task": episode.task, "env_seed": episode.seed,
                                      "env_episode": episode.episode})
            recorded += 1
            successes += int(success)
            frames_total += len(frames["action"])
    return RecordSummary(Path(out), recorded, frames_total, successes, time.perf_counter() - start)


__all__ = ["RecordSummary", "dataset_features", "record_episodes"]
