"""Datasets for training: `open_dataset(root)` reads a dataset on disk as a map-style torch Dataset.

Supported formats, detected from what is on disk:
- LeRobot v3.0 folders (meta/info.json with codebase_version "v3.0"): `LeRobotV3Dataset`.
- LeRobot v2.1 folders (codebase_version "v2.1": per-episode parquet and mp4 files): `LeRobotV21Dataset`, the values
  LeRobot 0.3's reader gives; `embodyhpc data convert SRC --to v3.0 --out DST` rewrites one as v3.0.
- HDF5 files in the robomimic/LIBERO layout (data/demo_<i>/{obs/..., actions}): `HDF5EpisodeDataset`.

    from embodyhpc.data import open_dataset
    dataset = open_dataset("/data/my_lerobot_dataset", delta_timestamps={"action": [0.0, 0.1, 0.2]})
    item = dataset[0]   # the same keys, shapes, dtypes and values LeRobot's LeRobotDataset[0] gives

Importing this package does not import torch (the CLI imports data modules); the readers do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from embodyhpc.data.errors import DatasetError
from embodyhpc.data.formats import detect_format

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from embodyhpc.data.hdf5 import HDF5EpisodeDataset
    from embodyhpc.data.lerobot import LeRobotV3Dataset
    from embodyhpc.data.lerobot_v21 import LeRobotV21Dataset

__all__ = ["DatasetError", "HDF5EpisodeDataset", "LeRobotV21Dataset", "LeRobotV3Dataset", "detect_format",
           "open_dataset"]


def open_dataset(root: str | os.PathLike, delta_timestamps: Mapping[str, Sequence[float]] | None = None,
                 **options: Any) -> Dataset:
    """A map-style Dataset over `root`, whatever its supported format.

    delta_timestamps: LeRobot's form, {feature key: [seconds relative to the frame, ...]}; each key gets
        a leading time axis and a bool `<key>_is_pad` mask for times outside the episode.
    options: passed to the format's reader. LeRobot: video_backend ("auto", "torchcodec", "pyav" or a
        FrameDecoder), tolerance_s. HDF5: fps (default 20), task, tolerance_s.
    """
    fmt = detect_format(root)
    if fmt == "lerobot-v3.0":
        from embodyhpc.data.lerobot import LeRobotV3Dataset

        return LeRobotV3Dataset(root, delta_timestamps, **options)
    if fmt == "lerobot-v2.1":
        from embodyhpc.data.lerobot_v21 import LeRobotV21Dataset

        return LeRobotV21Dataset(root, delta_timestamps, **options)
    from embodyhpc.data.hdf5 import HDF5EpisodeDataset

    return HDF5EpisodeDataset(root, delta_timestamps, **options)


def __getattr__(name: str) -> Any:
    # The reader classes load torch, pyarrow and h5py: import them on first use only.
    if name == "LeRobotV3Dataset":
        from embodyhpc.data.lerobot import LeRobotV3Dataset

        return LeRobotV3Dataset
    if name == "LeRobotV21Dataset":
        from embodyhpc.data.lerobot_v21 import LeRobotV21Dataset

        return LeRobotV21Dataset
    if name == "HDF5EpisodeDataset":
        from embodyhpc.data.hdf5 import HDF5EpisodeDataset

        return HDF5EpisodeDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
