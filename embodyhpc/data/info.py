"""`embodyhpc data info PATH`: what a dataset holds, from its metadata (no frames decoded).

LeRobot v3.0: meta/info.json (fps, features, totals), meta/tasks.parquet, meta/episodes.
HDF5 (robomimic/LIBERO layout): the demo groups, their lengths and the observation arrays.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from embodyhpc.data.formats import detect_format, read_lerobot_info


def dataset_info(root: str | os.PathLike) -> dict[str, Any]:
    path = Path(root)
    fmt = detect_format(path)
    info = _lerobot(path) if fmt == "lerobot-v3.0" else _hdf5(path)
    size = path.stat().st_size if path.is_file() else sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file())
    return {"path": str(path), "format": fmt, **info, "size_bytes": size}


def _lerobot(root: Path) -> dict[str, Any]:
    import pyarrow.parquet as pq

    meta = read_lerobot_info(root)
    features = {name: {"dtype": spec["dtype"], "shape": list(spec["shape"]),
                       **({"codec": spec.get("info", {}).get("video.codec")} if spec["dtype"] == "video" else {})}
                for name, spec in meta["features"].items()}
    tasks_table = pq.read_table(root / "meta" / "tasks.parquet")
    index_col = next((c for c in tasks_table.column_names if c not in ("task_index",)), None)
    tasks = sorted(str(t) for t in tasks_table.column(index_col).to_pylist()) if index_col else []
    episode_files = sorted((root / "meta" / "episodes").rglob("*.parquet"))
    lengths = [n for f in episode_files for n in pq.read_table(f, columns=["length"]).column("length").to_pylist()]
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

    with h5py.File(path, "r") as f:
        demos = sorted(f["data"])
        lengths = [int(f["data"][d]["actions"].shape[0]) for d in demos]
        first = f["data"][demos[0]] if demos else None
        features = {} if first is None else {
            **{f"obs/{k}": {"dtype": str(v.dtype), "shape": list(v.shape[1:])} for k, v in first["obs"].items()},
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
    HDF5 dataset, its first and last MiB)."""
    import hashlib

    path = Path(root)
    digest = hashlib.sha256()
    if path.is_file():
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            digest.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            digest.update(f.read(1 << 20))
        return digest.hexdigest()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path).as_posix()
        digest.update(f"{relative}\0{file.stat().st_size}\0".encode())
        if relative.startswith("meta/"):
            digest.update(file.read_bytes())
    return digest.hexdigest()
