"""Which reader a dataset path needs, decided from what is on disk (no torch import here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from embodyhpc.data.errors import DatasetError

LEROBOT_CODEBASE_VERSION = "v3.0"
HDF5_SUFFIXES = (".hdf5", ".h5")


def read_lerobot_info(root: Path) -> dict[str, Any]:
    """meta/info.json of a LeRobot dataset folder."""
    path = root / "meta" / "info.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError("no meta/info.json: expected a LeRobot v3.0 dataset folder "
                           "(meta/info.json, meta/episodes/, data/, videos/)", where=str(root)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"invalid JSON: {exc}", where=str(path)) from None
    if not isinstance(info, dict):
        raise DatasetError(f"holds a JSON {type(info).__name__}, not an object", where=str(path))
    return info


def check_lerobot_version(root: Path, info: dict[str, Any]) -> None:
    version = info.get("codebase_version")
    if version != LEROBOT_CODEBASE_VERSION:
        raise DatasetError(f"LeRobot dataset with codebase_version {version!r}; only {LEROBOT_CODEBASE_VERSION!r} "
                           "is supported", where=str(root / "meta" / "info.json"),
                           fix="convert it with LeRobot's v2.1 -> v3.0 conversion script")


def detect_format(root: str | os.PathLike) -> str:
    """"lerobot-v3.0" or "hdf5"; otherwise a DatasetError says what was found and what was expected."""
    root = Path(root)
    if not root.exists():
        raise DatasetError("dataset path does not exist", where=str(root))
    if root.is_file():
        if root.suffix in HDF5_SUFFIXES:
            return "hdf5"
        raise DatasetError(f"a file that is not HDF5 ({', '.join(HDF5_SUFFIXES)})", where=str(root),
                           fix="point at a LeRobot v3.0 dataset folder or an HDF5 file")
    check_lerobot_version(root, read_lerobot_info(root))
    return "lerobot-v3.0"
