"""What a recipe's checks need to know about a dataset, from its metadata alone (no frame decoded, no torch).

    facts = dataset_facts("/data/my_lerobot_dataset")
    facts.fps, facts.shortest_episode, facts.features["observation.state"], facts.cameras, facts.tasks

Feature names are those of the items training reads (the readers' names: LeRobot's as stored; for HDF5
`observation.images.<name>` for uint8 H x W x 3 arrays, `observation.<name>` for the others, and `action`), so a
check can name the key a recipe refers to (data.delta_timestamps, model.state_key). A dataset that cannot be read
is a DatasetError naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from embodyhpc.data.errors import DatasetError

HDF5_DEFAULT_FPS = 20
"""The frame rate the HDF5 reader assumes (robomimic/LIBERO files record none): LIBERO's 20 Hz."""
HDF5_INDEX_FEATURES = ("timestamp", "frame_index", "episode_index", "index", "task_index")
IMAGE_PREFIX = "observation.images."


@dataclass(frozen=True)
class DatasetFacts:
    root: str
    format: str
    """"lerobot-v3.0", "lerobot-v2.1" or "hdf5"."""
    fps: float
    num_episodes: int
    shortest_episode: int
    """Frames of the shortest episode (0 for a dataset without episodes)."""
    longest_episode: int
    features: dict[str, tuple[int, ...]]
    """Item key -> the shape of one frame of it (cameras: as stored, H x W x 3 or 3 x H x W)."""
    tasks: tuple[str, ...]
    """Every task instruction the dataset holds."""

    @property
    def cameras(self) -> list[str]:
        return sorted(key for key in self.features if key.startswith(IMAGE_PREFIX))


def dataset_facts(root: str | os.PathLike) -> DatasetFacts:
    from embodyhpc.data.info import dataset_info

    info = dataset_info(root)
    lengths = info.get("episode_length") or {"min": 0, "max": 0}
    if info["format"] == "hdf5":
        features = _hdf5_features(info["features"])
        fps: float = HDF5_DEFAULT_FPS
        tasks = _hdf5_tasks(Path(root))
    else:
        features = {name: tuple(int(n) for n in spec["shape"]) for name, spec in info["features"].items()}
        fps = float(info["fps"])
        tasks = tuple(info.get("tasks") or ())
    return DatasetFacts(root=str(root), format=info["format"], fps=fps, num_episodes=int(info["num_episodes"]),
                        shortest_episode=int(lengths["min"]), longest_episode=int(lengths["max"]),
                        features=features, tasks=tasks)


def _hdf5_features(stored: dict[str, dict]) -> dict[str, tuple[int, ...]]:
    """The HDF5 reader's item keys (data/hdf5.py) for the arrays of the file's first demo."""
    features: dict[str, tuple[int, ...]] = {}
    for name, spec in stored.items():
        shape = tuple(int(n) for n in spec["shape"])
        if name == "actions":
            features["action"] = shape
            continue
        obs = name.removeprefix("obs/")
        image = spec["dtype"] == "uint8" and len(shape) == 3 and shape[-1] == 3
        features[f"{IMAGE_PREFIX}{obs}" if image else f"observation.{obs}"] = shape
    features.update({key: () for key in HDF5_INDEX_FEATURES})
    return features


def _hdf5_tasks(path: Path) -> tuple[str, ...]:
    """The instruction the HDF5 reader gives every item: data/problem_info's language_instruction."""
    import h5py

    try:
        with h5py.File(path, "r") as f:
            problem_info = f["data"].attrs.get("problem_info")
        task = json.loads(problem_info).get("language_instruction", "") if problem_info else ""
    except (OSError, KeyError, ValueError, AttributeError) as exc:
        raise DatasetError(f"cannot read data/problem_info: {' '.join(str(exc).split())[:200]}",
                           where=str(path)) from None
    return (str(task),)
