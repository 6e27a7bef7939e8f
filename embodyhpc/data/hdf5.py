"""HDF5 episodes in the robomimic / LIBERO layout, read as a map-style torch Dataset.

Layout:
    data/                       attrs may hold "problem_info" (LIBERO: JSON with "language_instruction")
      demo_<i>/actions          (T, action_dim)
      demo_<i>/obs/<name>       (T, ...): images are uint8 (T, H, W, 3); anything else is a vector

Items follow the LeRobot naming so the same training code reads either format:
    "observation.images.<name>"  float32 (C, H, W) in [0, 1]   (uint8 HWC images in the file)
    "observation.<name>"         float32 (other observations; floats are cast to float32)
    "action"                     float32
    "timestamp"                  float32 frame_index / fps (robomimic and LIBERO record at 20 Hz)
    "frame_index", "episode_index", "index", "task_index"   int64 scalars;  "task" str
With image_dtype="uint8" (data.image_dtype) images are uint8 (C, H, W) as stored: the float item times 255 exactly.
Demos are ordered by their number (demo_2 before demo_10); episode_index is the position in that order.
The file is opened lazily in each process: an h5py handle must not cross a DataLoader fork.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from embodyhpc.data.decode_device import check_image_dtype
from embodyhpc.data.delta import clamp_to_episode, delta_steps
from embodyhpc.data.errors import DatasetError, SampleError
from embodyhpc.data.facts import HDF5_DEFAULT_FPS

DEFAULT_FPS = HDF5_DEFAULT_FPS
_INHERITED_FILES: list[Any] = []  # h5py handles a forked child inherited: kept, never closed in the child


def _is_image(dataset: Any) -> bool:
    return dataset.dtype == np.uint8 and dataset.ndim == 4 and dataset.shape[-1] == 3


def _demo_number(name: str) -> int:
    match = re.fullmatch(r"demo_(\d+)", name)
    return int(match.group(1)) if match else -1


class HDF5EpisodeDataset(Dataset):
    """All steps of all demos of one robomimic/LIBERO-style HDF5 file; item i is global step i."""

    def __init__(self, path: str | os.PathLike, delta_timestamps: Mapping[str, Sequence[float]] | None = None,
                 *, fps: float = DEFAULT_FPS, task: str | None = None, tolerance_s: float = 1e-4,
                 image_dtype: str = "float32") -> None:
        import h5py

        self.image_dtype = check_image_dtype(image_dtype)
        self.decode_seconds = 0.0
        """Seconds this process spent reading image arrays (the loader's decode time per sample)."""
        self.path = Path(path)
        self.fps = fps
        try:
            with h5py.File(self.path, "r") as f:
                self._read_layout(f, task)
        except OSError as exc:
            raise DatasetError(f"cannot open as HDF5: {exc}", where=str(self.path)) from None
        self.delta_indices = delta_steps(delta_timestamps, self.features, fps, tolerance_s)
        self._file: Any = None
        self._file_pid = -1

    def _read_layout(self, f: Any, task: str | None) -> None:
        where = str(self.path)
        import h5py

        if not isinstance(f.get("data"), h5py.Group):
            raise DatasetError("no 'data' group: expected the robomimic/LIBERO layout data/demo_<i>/{obs/...,actions}",
                               where=where)
        self.demos = sorted((n for n in f["data"] if _demo_number(n) >= 0), key=_demo_number)
        if not self.demos:
            raise DatasetError("no data/demo_<i> groups", where=where)
        first = f["data"][self.demos[0]]
        if "actions" not in first or "obs" not in first:
            raise DatasetError(f"data/{self.demos[0]} lacks 'actions' or 'obs'", where=where)
        # File name -> item key, for the observations of the first demo (all demos must share them).
        self.obs_keys = {name: f"observation.images.{name}" if _is_image(first["obs"][name]) else f"observation.{name}"
                         for name in first["obs"]}
        self._obs_name_of = {key: name for name, key in self.obs_keys.items()}
        self.image_keys = [k for k in self.obs_keys.values() if k.startswith("observation.images.")]
        self.features = [*self.obs_keys.values(), "action", "timestamp", "frame_index", "episode_index", "index",
                         "task_index"]
        lengths = []
        for name in self.demos:
            demo = f["data"][name]
            length = demo["actions"].shape[0]
            for obs_name in self.obs_keys:
                if obs_name not in demo["obs"] or demo["obs"][obs_name].shape[0] != length:
                    raise DatasetError(f"data/{name}/obs/{obs_name} missing or not {length} steps long", where=where)
            lengths.append(length)
        self.episode_ends = np.cumsum(lengths)  # global row after each demo's last step
        self.episode_starts = self.episode_ends - np.asarray(lengths)
        if task is None:
            problem_info = f["data"].attrs.get("problem_info")
            task = json.loads(problem_info).get("language_instruction", "") if problem_info else ""
        self.task = str(task)

    @property
    def num_episodes(self) -> int:
        return len(self.demos)

    def __len__(self) -> int:
        return int(self.episode_ends[-1])

    def _demo(self, episode: int) -> Any:
        if self._file is None or self._file_pid != os.getpid():
            import h5py

            if self._file is not None:
                _INHERITED_FILES.append(self._file)
            self._file = h5py.File(self.path, "r")
            self._file_pid = os.getpid()
        return self._file["data"][self.demos[episode]]

    def first_video_file(self) -> None:
        """No video: frames are arrays in the file (nothing for data.decode_device to decode)."""
        return None

    def set_frame_options(self, *, image_dtype: str | None = None, decoder: Any = None) -> None:
        """data.image_dtype (data/loader.py); an HDF5 file decodes no video, so it takes no decoder."""
        if decoder is not None:
            raise ValueError(f"{self.path}: an HDF5 dataset decodes no video and takes no frame decoder")
        if image_dtype is not None:
            self.image_dtype = check_image_dtype(image_dtype)

    def _read(self, demo: Any, key: str, rows: np.ndarray) -> torch.Tensor:
        """Rows of one feature, rows relative to the demo, in the item's dtype; shape (len(rows), ...)."""
        started = time.perf_counter()
        source = demo["actions"] if key == "action" else demo["obs"][self._obs_name_of[key]]
        unique, inverse = np.unique(rows, return_inverse=True)  # h5py wants increasing, unique indices
        values = torch.from_numpy(np.asarray(source[unique])[inverse])
        if key in self.image_keys:
            values = values.permute(0, 3, 1, 2)
            self.decode_seconds += time.perf_counter() - started
            return values.contiguous() if self.image_dtype == "uint8" else values.to(torch.float32).div_(255)
        return values.to(torch.float32) if values.dtype.is_floating_point else values

    def __getitem__(self, idx: int) -> dict[str, Any]:
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"step {idx} out of range for a dataset of {len(self)} steps")
        episode = int(np.searchsorted(self.episode_ends, idx, side="right"))
        first, end = int(self.episode_starts[episode]), int(self.episode_ends[episode])
        item: dict[str, Any] = {}
        pads = {}
        key = ""
        try:
            demo = self._demo(episode)
            for key in [*self.obs_keys.values(), "action"]:
                if key in self.delta_indices:
                    rows, pads[key] = clamp_to_episode(idx, self.delta_indices[key], first, end)
                    item[key] = self._read(demo, key, rows - first)
                    if key in self.image_keys and len(rows) == 1:  # LeRobot squeezes a one-frame camera query
                        item[key] = item[key][0]
                else:
                    item[key] = self._read(demo, key, np.array([idx - first]))[0]
        except Exception as exc:  # noqa: BLE001 - h5py raises OSError, KeyError, ValueError for damaged files
            what = f"cannot read {key}" if key else "cannot open the file"
            raise SampleError(f"episode {episode} (data/{self.demos[episode]}), step {idx - first}: {what} ("
                              f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]})", where=str(self.path),
                              fix="restore the file from the dataset's source, or set data.on_bad_sample=skip to "
                                  "train without the samples it breaks") from exc
        frame = idx - first
        item["timestamp"] = torch.tensor(frame / self.fps, dtype=torch.float32)
        item["frame_index"] = torch.tensor(frame)
        item["episode_index"] = torch.tensor(episode)
        item["index"] = torch.tensor(idx)
        item["task_index"] = torch.tensor(0)
        for key in set(self.delta_indices) - set(pads):  # time/index features with a time axis
            rows, pads[key] = clamp_to_episode(idx, self.delta_indices[key], first, end)
            item[key] = self._scalar_feature(key, rows, first, episode)
        item.update({f"{key}_is_pad": torch.from_numpy(is_pad) for key, is_pad in pads.items()})
        item["task"] = self.task
        return item

    def _scalar_feature(self, key: str, rows: np.ndarray, first: int, episode: int) -> torch.Tensor:
        rows = torch.from_numpy(rows)
        if key == "timestamp":
            return ((rows - first) / self.fps).to(torch.float32)
        return {"frame_index": rows - first, "episode_index": torch.full_like(rows, episode), "index": rows,
                "task_index": torch.zeros_like(rows)}[key]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_file"] = None
        return state

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(path={str(self.path)!r}, steps={len(self)}, episodes={self.num_episodes}, "
                f"fps={self.fps}, cameras={self.image_keys})")
