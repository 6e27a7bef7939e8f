"""`embodyhpc data info PATH`: what a dataset holds, from its metadata (no frames decoded).

LeRobot v3.0: meta/info.json (fps, features, totals), meta/tasks.parquet, meta/episodes.
LeRobot v2.1: meta/info.json, meta/tasks.jsonl, meta/episodes.jsonl.
HDF5 (robomimic/LIBERO layout): the demo groups, their lengths and the observation arrays.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from embodyhpc.data.errors import DatasetError
from embodyhpc.data.formats import detect_format, read_lerobot_info


def dataset_info(root: str | os.PathLike) -> dict[str, Any]:
    """What the dataset at `root` holds, from its metadata; a DatasetError (one line: the file and what is wrong) for
    a path that is not a readable dataset: missing, unreadable, a corrupt HDF5 file, metadata missing a key."""
    path = Path(root)
    try:
        fmt = detect_format(path)
        info = _hdf5(path) if fmt == "hdf5" else _lerobot(path, fmt)
        size = path.stat().st_size if path.is_file() else sum(
            p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError as exc:  # permissions, a folder that vanished, an I/O error
        raise DatasetError(f"cannot read: {exc.strerror or exc}", where=str(exc.filename or path),
                           fix="check the path and its permissions") from None
    return {"path": str(path), "format": fmt, **info, "size_bytes": size}


def _read_parquet(path: Path, columns: list[str] | None = None) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, columns=columns)
    except FileNotFoundError:
        raise DatasetError("file missing: a LeRobot v3.0 dataset has it", where=str(path)) from None
    except (pa.ArrowException, KeyError) as exc:  # not parquet, or a named column that is absent
        raise DatasetError(f"cannot read parquet: {' '.join(str(exc).split())[:200]}", where=str(path)) from None


def _lerobot(root: Path, fmt: str) -> dict[str, Any]:
    meta = read_lerobot_info(root)
    where = str(root / "meta" / "info.json")
    missing = [k for k in ("features", "fps", "total_episodes", "total_frames") if k not in meta]
    if missing:
        raise DatasetError(f"missing {', '.join(missing)}: not a LeRobot {fmt.removeprefix('lerobot-')} info.json",
                           where=where)
    specs = meta["features"]
    if not isinstance(specs, dict) or not all(isinstance(v, dict) and "dtype" in v and "shape" in v
                                              for v in specs.values()):
        raise DatasetError("must map each feature name to {dtype, shape, ...}", where=where, key="features")
    features = {name: {"dtype": spec["dtype"], "shape": list(spec["shape"]),
                       **({"codec": (spec.get("info") or {}).get("video.codec")} if spec["dtype"] == "video" else {})}
                for name, spec in specs.items()}
    if fmt == "lerobot-v2.1":
        from embodyhpc.data.v21_meta import read_episodes, read_tasks

        tasks = sorted(read_tasks(root).values())
        lengths = [episode.length for episode in read_episodes(root)]
    else:
        tasks_table = _read_parquet(root / "meta" / "tasks.parquet")
        index_col = next((c for c in tasks_table.column_names if c not in ("task_index",)), None)
        tasks = sorted(str(t) for t in tasks_table.column(index_col).to_pylist()) if index_col else []
        episode_files = sorted((root / "meta" / "episodes").rglob("*.parquet"))
        lengths = [n for f in episode_files for n in _read_parquet(f, ["length"]).column("length").to_pylist()]
    return {
        "fps": meta["fps"],
        "robot_type": meta.get("robot_type"),
        "num_episodes": meta["total_episodes"],
        "num_frames": meta["total_frames"],
        "episode_length": {"min": min(lengths), "max": max(lengths)} if lengths else None,
        "cameras": [name for name, spec in features.items() if spec["dtype"] == "video"],
        "tasks": tasks,
        "features": features,
    }


def _hdf5(path: Path) -> dict[str, Any]:
    import h5py

    try:
        file = h5py.File(path, "r")
    except OSError as exc:
        raise DatasetError(f"cannot open as HDF5: {' '.join(str(exc).split())}", where=str(path),
                           fix="point at an HDF5 file (robomimic/LIBERO layout) or a LeRobot v3.0 folder") from None
    with file as f:
        data = f.get("data")
        if not isinstance(data, h5py.Group):
            raise DatasetError("no 'data' group: expected the robomimic/LIBERO layout data/demo_<i>/{obs/...,actions}",
                               where=str(path))
        demos = sorted(data)
        lacking = next((d for d in demos if not isinstance(data[d], h5py.Group)
                        or not isinstance(data[d].get("actions"), h5py.Dataset)), None)
        if lacking is not None:
            raise DatasetError(f"data/{lacking} has no 'actions' array", where=str(path))
        lengths = [int(data[d]["actions"].shape[0]) for d in demos]
        first = data[demos[0]] if demos else None
        observations = first.get("obs") if first is not None else None
        features = {} if first is None else {
            **({f"obs/{k}": {"dtype": str(v.dtype), "shape": list(v.shape[1:])} for k, v in observations.items()
                if isinstance(v, h5py.Dataset)} if isinstance(observations, h5py.Group) else {}),
            "actions": {"dtype": str(first["actions"].dtype), "shape": list(first["actions"].shape[1:])}}
    return {"num_episodes": len(demos), "num_frames": sum(lengths),
            "episode_length": {"min": min(lengths), "max": max(lengths)} if lengths else None,
            "features": features}


def format_info(info: dict[str, Any]) -> str:
    lines = [f"{info['path']}: {info['format']}, {info['num_episodes']} episodes, {info['num_frames']} frames"
             + (f" at {info['fps']} fps" if info.get("fps") else "") + f", {info['size_bytes'] / 1e6:.2f} MB"]
    if info.get("episode_length"):
        lines.append(f"  episode length: {info['episode_length']['min']}..{info['episode_length']['max']} frames")
    if info.get("tasks"):
        lines.append(f"  tasks ({len(info['tasks'])}): " + "; ".join(info["tasks"]))
    for name, spec in info["features"].items():
        codec = f" ({spec['codec']})" if spec.get("codec") else ""
        lines.append(f"  {name}: {spec['dtype']} {spec['shape']}{codec}")
    return "\n".join(lines) + "\n"


def dataset_fingerprint(root: str | os.PathLike) -> str:
    """A sha256 (hex) that changes when the dataset does, read in milliseconds whatever its size: every file's
    relative path and size, plus the content of the metadata (LeRobot's meta/ folder; for a single file such as an
    HDF5 dataset, its name, size and first and last MiB)."""
    return _digest(root, where=True)


def dataset_identity(root: str | os.PathLike) -> str:
    """A sha256 (hex) of what a dataset holds, not of where it is: every file under its meta/ folder (LeRobot's
    info, statistics, episodes and tasks; relative path and content), or for a single-file dataset (HDF5) its size
    and first and last MiB. A staged copy has the identity of its source (staging's own control files are outside
    meta/); another dataset, even one of the same length, has another."""
    return _digest(root, where=False)


def _digest(root: str | os.PathLike, *, where: bool) -> str:
    """dataset_fingerprint's (where: every file's path and size, a single file's name) or dataset_identity's."""
    import hashlib

    path = Path(root)
    digest = hashlib.sha256()
    if path.is_file():
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode() if where else f"{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
        return digest.hexdigest()
    for file in sorted(p for p in (path if where else path / "meta").rglob("*") if p.is_file()):
        relative = file.relative_to(path).as_posix()
        digest.update(f"{relative}\0{file.stat().st_size}\0".encode())
        if relative.startswith("meta/"):
            digest.update(file.read_bytes())
    return digest.hexdigest()
