"""Which reader a dataset path needs, decided from what is on disk (no torch import here)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from embodyhpc.data.errors import DatasetError

LEROBOT_CODEBASE_VERSION = "v3.0"
"""The version this project writes (data/writer.py) and converts to."""
LEROBOT_READABLE_VERSIONS = ("v3.0", "v2.1")
HDF5_SUFFIXES = (".hdf5", ".h5")


def read_lerobot_info(root: Path) -> dict[str, Any]:
    """meta/info.json of a LeRobot dataset folder."""
    path = root / "meta" / "info.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError("no meta/info.json: expected a LeRobot v3.0 or v2.1 dataset "
                           "folder (meta/info.json, meta/, data/, videos/)", where=str(root)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"invalid JSON: {exc}", where=str(path)) from None
    if not isinstance(info, dict):
        raise DatasetError(f"holds a JSON {type(info).__name__}, not an object", where=str(path))
    return info


def check_lerobot_version(root: Path, info: dict[str, Any], expected: str | None = None) -> str:
    """The folder's codebase_version, when this project reads it (`expected`: that one only); otherwise a one-line
    DatasetError naming meta/info.json and how to convert the folder."""
    version = info.get("codebase_version")
    where = str(root / "meta" / "info.json")
    if expected is not None and version != expected and version in LEROBOT_READABLE_VERSIONS:
        raise DatasetError(f"LeRobot dataset with codebase_version {version!r}; this reader takes {expected!r}",
                           where=where, fix="open it with embodyhpc.data.open_dataset, which picks the reader")
    if version in LEROBOT_READABLE_VERSIONS:
        return version
    shown = str(version)[:20] if isinstance(version, str) else repr(version)[:20]
    readable = " and ".join(repr(v) for v in LEROBOT_READABLE_VERSIONS)
    if version == "v2.0":
        raise DatasetError(f"LeRobot dataset with codebase_version {shown!r}; only {readable} are read", where=where,
                           fix="convert it to v2.1 with LeRobot 0.3's `python -m "
                               "lerobot.datasets.v21.convert_dataset_v20_to_v21`, then read it or run `embodyhpc "
                               "data convert SRC --to v3.0 --out DST`")
    raise DatasetError(f"LeRobot dataset with codebase_version {shown!r}; only {readable} are read", where=where,
                       fix="a v2.1 folder can be converted with `embodyhpc data convert SRC --to v3.0 --out DST`; "
                           "older ones with LeRobot's converters")


def detect_format(root: str | os.PathLike) -> str:
    """"lerobot-v3.0", "lerobot-v2.1" or "hdf5"; otherwise a DatasetError says what was found and what was
    expected."""
    root = Path(root)
    if not root.exists():
        raise DatasetError("dataset path does not exist", where=str(root))
    if root.is_file():
        if root.suffix in HDF5_SUFFIXES:
            return "hdf5"
        raise DatasetError(f"a file that is not HDF5 ({', '.join(HDF5_SUFFIXES)})", where=str(root),
                           fix="point at a LeRobot v3.0 dataset folder or an HDF5 file")
    return f"lerobot-{check_lerobot_version(root, read_lerobot_info(root))}"
