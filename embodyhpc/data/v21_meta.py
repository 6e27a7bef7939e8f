"""The metadata of a LeRobot v2.1 dataset folder, read and checked without torch (the CLI's `data info` and
`data convert`, the recipe checks and the reader share it).

Layout (written by LeRobot 0.1 to 0.3; learned from LeRobot 0.3.3's reader, written here from scratch):
    meta/info.json               codebase_version "v2.1", fps, features, chunks_size, and the path templates
                      data_path  "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
                      video_path "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
                                 (episode_chunk = episode_index // chunks_size)
    meta/episodes.jsonl          one JSON object a line: episode_index, tasks (strings), length (frames)
    meta/tasks.jsonl             one JSON object a line: task_index, task
    meta/episodes_stats.jsonl    one JSON object a line: episode_index, stats {feature: {min, max, mean, std, count}}
    data/chunk-*/episode_*.parquet      one file per episode, one row per frame, `index` global
    videos/chunk-*/<camera>/episode_*.mp4   one file per episode and camera; its first frame is at 0 s, as the
                                        episode's `timestamp` column is (both restart in every episode)

LeRobot's reader places episode e at the rows [sum of lengths before e, + length e) of the data files read in
order: episodes must be numbered 0..N-1 and each data file must hold `length` rows. Anything else is a DatasetError
naming the file (one line).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embodyhpc.data.errors import DatasetError

CODEBASE_VERSION = "v2.1"
EPISODES_FILE = "meta/episodes.jsonl"
TASKS_FILE = "meta/tasks.jsonl"
EPISODES_STATS_FILE = "meta/episodes_stats.jsonl"
STATS_KEYS = ("min", "max", "mean", "std", "count")


@dataclass(frozen=True)
class V21Episode:
    index: int
    length: int
    tasks: tuple[str, ...]


def read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file, each holding `required`; a DatasetError names the file and line."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DatasetError("file missing: a LeRobot v2.1 dataset has it", where=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read: {getattr(exc, 'strerror', None) or exc}", where=str(path)) from None
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"line {number}: invalid JSON ({exc.msg})", where=str(path)) from None
        missing = [k for k in required if not isinstance(row, dict) or k not in row]
        if missing:
            raise DatasetError(f"line {number}: missing {', '.join(missing)}", where=str(path))
        rows.append(row)
    return rows


def _whole(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DatasetError(f"{what} is {value!r}, not a whole number >= 0", where=where)
    return value


def read_episodes(root: Path) -> list[V21Episode]:
    """meta/episodes.jsonl in episode order; the indices must be 0..N-1 (LeRobot finds an episode's rows by its
    index), each length >= 1."""
    path = root / EPISODES_FILE
    episodes = []
    for row in read_jsonl(path, ("episode_index", "length")):
        index = _whole(row["episode_index"], "episode_index", str(path))
        length = _whole(row["length"], f"episode {index}: length", str(path))
        if length < 1:
            raise DatasetError(f"episode {index} has length 0", where=str(path))
        tasks = row.get("tasks") or []
        episodes.append(V21Episode(index, length, tuple(str(t) for t in tasks)))
    if not episodes:
        raise DatasetError("no episodes", where=str(path))
    episodes.sort(key=lambda e: e.index)
    for position, episode in enumerate(episodes):
        if episode.index != position:
            problem = "listed twice" if episode.index < position else "missing"
            raise DatasetError(f"episode {position} is {problem} (episodes must be numbered 0..N-1, as LeRobot's "
                               "v2.1 reader requires)", where=str(path))
    return episodes


def read_tasks(root: Path) -> dict[int, str]:
    """meta/tasks.jsonl: {task_index: task}."""
    path = root / TASKS_FILE
    tasks: dict[int, str] = {}
    for row in read_jsonl(path, ("task_index", "task")):
        index = _whole(row["task_index"], "task_index", str(path))
        if index in tasks:
            raise DatasetError(f"task_index {index} is listed twice", where=str(path))
        tasks[index] = str(row["task"])
    return dict(sorted(tasks.items()))


def episode_path(root: Path, info: dict[str, Any], template_key: str, episode: int, video_key: str | None = None
                 ) -> Path:
    """The file info.json's `data_path` / `video_path` template names for an episode, inside `root`."""
    where = str(root / "meta" / "info.json")
    template = info.get(template_key)
    chunks_size = info.get("chunks_size")
    if not isinstance(template, str) or not template:
        raise DatasetError(f"{template_key} is {template!r}, not a path template", where=where, key=template_key)
    if isinstance(chunks_size, bool) or not isinstance(chunks_size, int) or chunks_size < 1:
        raise DatasetError(f"chunks_size is {chunks_size!r}, not a whole number >= 1", where=where, key="chunks_size")
    try:
        relative = template.format(episode_chunk=episode // chunks_size, episode_index=episode, video_key=video_key)
    except (KeyError, IndexError, ValueError) as exc:
        raise DatasetError(f"template {template!r} cannot be filled in ({type(exc).__name__}: {exc}); v2.1 "
                           "templates use {episode_chunk}, {episode_index} and {video_key}", where=where,
                           key=template_key) from None
    path = root / relative
    resolved_root = root.resolve()
    if Path(relative).is_absolute() or not path.resolve().is_relative_to(resolved_root):
        raise DatasetError(f"names {relative!r} for episode {episode}, outside the dataset folder", where=where,
                           key=template_key, fix="repair the template: files live under the dataset folder")
    return path


def read_episode_table(root: Path, info: dict[str, Any], episode: int, length: int, columns: list[str]) -> Any:
    """The pyarrow table of an episode's data file (those columns), checked: `length` rows (meta/episodes.jsonl's),
    all of this episode."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = episode_path(root, info, "data_path", episode)
    try:
        names = pq.read_schema(path).names
        missing = [c for c in columns if c not in names]
        if missing:
            raise DatasetError(f"missing columns {missing} that meta/info.json declares", where=str(path))
        table = pq.read_table(path, columns=columns)
    except FileNotFoundError:
        raise DatasetError(f"file missing ({EPISODES_FILE} lists episode {episode})", where=str(path)) from None
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"cannot read parquet: {' '.join(str(exc).split())[:300]}", where=str(path),
                           fix="restore the file from the dataset's source (it is truncated or not parquet)") from None
    if table.num_rows != length:
        raise DatasetError(f"holds {table.num_rows} frames; {EPISODES_FILE} gives episode {episode} length {length}",
                           where=str(path), fix=f"restore the file or its line in {EPISODES_FILE} from the dataset's "
                                                "source")
    if "episode_index" in table.column_names:
        found = np.unique(table.column("episode_index").to_numpy()).tolist()
        if found != [episode]:
            raise DatasetError(f"holds frames of episode(s) {found[:5]}, not {episode}", where=str(path))
    return table


def read_episodes_stats(root: Path) -> dict[int, dict[str, dict[str, Any]]]:
    """meta/episodes_stats.jsonl: {episode_index: {feature: {stat: nested lists}}}."""
    path = root / EPISODES_STATS_FILE
    stats = {}
    for row in read_jsonl(path, ("episode_index", "stats")):
        if not isinstance(row["stats"], dict):
            raise DatasetError(f"episode {row['episode_index']}: stats is not an object", where=str(path))
        stats[_whole(row["episode_index"], "episode_index", str(path))] = row["stats"]
    return stats


def aggregate_stats(per_episode: list[dict[str, dict[str, Any]]], where: str = EPISODES_STATS_FILE
                    ) -> dict[str, dict[str, list]]:
    """One stats.json-like entry per feature from per-episode ones, as LeRobot aggregates them: min of the minima,
    max of the maxima, the count-weighted mean, and the pooled variance (each episode's variance plus its mean's
    squared distance from the total mean, weighted by count); count the sum. A feature missing from some episodes
    is aggregated over those that have it."""
    import numpy as np

    features = sorted({key for stats in per_episode for key in stats})
    out: dict[str, dict[str, list]] = {}
    for feature in features:
        entries = [stats[feature] for stats in per_episode if feature in stats]
        try:
            arrays = {k: [np.asarray(e[k], dtype=np.float64) for e in entries] for k in STATS_KEYS}
            mean, std, count = (np.stack(arrays[k]) for k in ("mean", "std", "count"))
            total = count.sum(axis=0)
            weights = count.reshape(count.shape + (1,) * (mean.ndim - count.ndim))
            total_mean = (mean * weights).sum(axis=0) / total
            variance = ((std ** 2 + (mean - total_mean) ** 2) * weights).sum(axis=0) / total
            out[feature] = {"min": np.min(np.stack(arrays["min"]), axis=0).tolist(),
                            "max": np.max(np.stack(arrays["max"]), axis=0).tolist(),
                            "mean": total_mean.tolist(), "std": np.sqrt(variance).tolist(),
                            "count": [int(total.reshape(-1)[0])]}
        except (KeyError, TypeError, ValueError) as exc:
            raise DatasetError(f"statistics of {feature!r} cannot be aggregated ({type(exc).__name__}: "
                               f"{' '.join(str(exc).split())[:150]})", where=where) from None
    return out


def v21_stats(root: str | os.PathLike) -> dict[str, dict[str, list]]:
    """What LeRobot 0.3's `LeRobotDatasetMetadata.stats` holds for a v2.1 folder: episodes_stats.jsonl aggregated
    (meta/stats.json, where a v2.1 folder still has one from v2.0, is not read: LeRobot ignores it too)."""
    root = Path(root)
    per_episode = read_episodes_stats(root)
    return aggregate_stats([per_episode[k] for k in sorted(per_episode)], str(root / EPISODES_STATS_FILE))
