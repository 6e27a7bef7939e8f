"""Datasets for training: `open_dataset(root)` reads a dataset on disk as a map-style torch Dataset.

Supported formats, detected from what is on disk:
- LeRobot v3.0 folders (meta/info.json with codebase_version "v3.0"): `LeRobotV3Dataset`.
- HDF5 files in the robomimic/LIBERO layout (data/demo_i/{obs/..., actions}): `HDF5EpisodeDataset`
  (needs h5py).

    from embodyhpc.data import open_dataset
    dataset = open_dataset("/data/my_lerobot_dataset", delta_timestamps={"action": [0.0, 0.1, 0.2]})
    item = dataset[0]   # the same keys, shapes, dtypes and values LeRobot's LeRobotDataset[0] gives
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from embodyhpc.data.errors import DatasetError
from embodyhpc.data.lerobot import CODEBASE_VERSION, LeRobotV3Dataset, read_info

HDF5_SUFFIXES = (".hdf5", ".h5")

__all__ = ["DatasetError", "LeRobotV3Dataset", "detect_format", "open_dataset"]


def detect_format(root: str | os.PathLike) -> str:
    """"lerobot-v3.0" or "hdf5"; a DatasetError says what was found and what was expected otherwise."""
    root = Path(root)
    if not root.exists():
        raise DatasetError("dataset path does not exist", where=str(root))
    if root.is_file():
        if root.suffix in HDF5_SUFFIXES:
            return "hdf5"
        raise DatasetError(f"a file that is not HDF5 ({', '.join(HDF5_SUFFIXES)})", where=str(root),
                           fix="point at a LeRobot v3.0 dataset folder or an HDF5 file")
    if not (root / "meta" / "info.json").is_file():
        raise DatasetError("no meta/info.json: expected a LeRobot v3.0 dataset folder "
                           "(meta/info.json, meta/episodes/, data/, videos/)", where=str(root))
    version = read_info(root).get("codebase_version")
    if version != CODEBASE_VERSION:
        raise DatasetError(f"LeRobot dataset with codebase_version {version!r}; only {CODEBASE_VERSION!r} is "
                           "supported", where=str(root / "meta" / "info.json"),
                           fix="convert it with LeRobot's v2.1 -> v3.0 conversion script")
    return "lerobot-v3.0"


def open_dataset(root: str | os.PathLike, delta_timestamps: Mapping[str, Sequence[float]] | None = None,
                 **options: Any) -> Dataset:
    """A map-style Dataset over `root`, whatever its supported format.

    delta_timestamps: LeRobot's form, {feature key: [seconds relative to the frame, ...]}; each key gets
        a leading time axis and a bool `<key>_is_pad` mask for times outside the episode.
    options: passed to the format's reader (for LeRobot: video_backend="auto"|"torchcodec"|"pyav",
        tolerance_s).
    """
    fmt = detect_format(root)
    if fmt == "lerobot-v3.0":
        return LeRobotV3Dataset(root, delta_timestamps, **options)
    from embodyhpc.data.hdf5 import HDF5EpisodeDataset  # h5py only when an HDF5 file is opened

    return HDF5EpisodeDataset(root, delta_timestamps, **options)
