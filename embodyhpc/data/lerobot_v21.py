"""LeRobot v2.1 datasets on disk (per-episode parquet and mp4 files), read as a map-style torch Dataset.

The layout and its checks are in data/v21_meta.py. Items are built by the v3.0 reader (data/lerobot.py) from the
same tables, so both versions give what LeRobot gives: LeRobot 0.3.3's `LeRobotDataset[i]` for a v2.1 folder
(tests/data/test_lerobot_v21.py holds it to values recorded from LeRobot itself). What differs from v3.0:
- episodes come from meta/episodes.jsonl: episode e spans the rows [sum of earlier lengths, + its length);
- every episode's data is its own parquet file, and every camera's video its own mp4 whose first frame is at 0 s:
  a frame is decoded at its stored `timestamp`, which restarts at 0 in every episode (no offset into a file);
- tasks come from meta/tasks.jsonl, statistics from meta/episodes_stats.jsonl (`v21_stats`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from embodyhpc.data.errors import DatasetError
from embodyhpc.data.lerobot import LeRobotV3Dataset
from embodyhpc.data.v21_meta import CODEBASE_VERSION, episode_path, read_episode_table, read_episodes, read_tasks


class LeRobotV21Dataset(LeRobotV3Dataset):
    """All frames of a LeRobot v2.1 dataset; item i is frame row i (its global `index`)."""

    codebase_version = CODEBASE_VERSION

    def _load_tasks(self) -> dict[int, str]:
        return read_tasks(self.root)

    def _load_episodes(self) -> None:
        episodes = read_episodes(self.root)
        lengths = np.array([e.length for e in episodes], dtype=np.int64)
        ends = np.cumsum(lengths)
        self._episodes = {"episode_index": np.arange(len(episodes), dtype=np.int64),
                          "dataset_from_index": ends - lengths, "dataset_to_index": ends}
        for key in self.video_keys:  # each episode's video is a file of its own: its frames start at 0 s
            self._episodes[f"videos/{key}/from_timestamp"] = np.zeros(len(episodes))
        self.num_episodes = len(episodes)

    def _load_frames(self) -> None:
        keys = [k for k in self.features if k not in self.video_keys]
        lengths = self._episodes["dataset_to_index"] - self._episodes["dataset_from_index"]
        tables = [read_episode_table(self.root, self.info, episode, length, keys)
                  for episode, length in enumerate(lengths.tolist())]
        self._set_frames(pa.concat_tables(tables), keys)
        self._check_timestamps()

    def _check_timestamps(self) -> None:
        """LeRobot's check at load: inside an episode, frames are 1/fps apart (within the tolerance)."""
        step = np.diff(self._timestamps_s)
        inside = np.ones(len(step), dtype=bool)
        inside[self._episodes["dataset_to_index"][:-1] - 1] = False  # the step from one episode to the next
        bad = np.flatnonzero(inside & (np.abs(step - 1 / self.fps) > self.tolerance_s))
        if bad.size:
            row = int(bad[0]) + 1
            episode = int(np.searchsorted(self._episodes["dataset_to_index"], row, side="right"))
            frame = row - int(self._episodes["dataset_from_index"][episode])
            raise DatasetError(f"episode {episode}, frame {frame}: timestamp {self._timestamps_s[row]:.6f} s is not "
                               f"1/{self.fps} s after the previous frame's {self._timestamps_s[row - 1]:.6f} s",
                               where=str(episode_path(self.root, self.info, "data_path", episode)))

    def video_path(self, key: str, episode_row: int) -> Path:
        return episode_path(self.root, self.info, "video_path", episode_row, video_key=key)

