"""LeRobot v3.0 datasets on disk, read as a map-style torch Dataset.

Layout (written by LeRobot >= 0.4):
    meta/info.json                          codebase_version "v3.0", fps, features, path patterns
    meta/tasks.parquet                      task_index per task string (the string is the pandas index)
    meta/episodes/chunk-*/file-*.parquet    one row per episode: dataset_from_index/_to_index (global
                                            frame rows [from, to)), data file, and per camera the video
                                            file plus from_timestamp of the episode inside that file
    data/chunk-*/file-*.parquet             one row per frame: non-video features
    videos/<camera>/chunk-*/file-*.mp4      all episodes of one camera concatenated

An item has the keys, shapes, dtypes and values LeRobot 0.4.4's `LeRobotDataset[i]` gives:
non-video features as stored (scalars 0-d), cameras float32 (C, H, W) in [0, 1], and "task" (str).
`delta_timestamps` ({key: [seconds, ...]}) adds a leading time axis to that key, with frames
outside the episode clamped to its first/last frame and flagged in a bool `<key>_is_pad`.

image_dtype="uint8" (data.image_dtype) gives the cameras as the decoded bytes, uint8 (C, H, W) in [0, 255]: the float
item times 255 exactly, every other key the same. `__getitems__` (what a DataLoader calls for a micro-batch) builds
the same items as `__getitem__` one by one, decoding all the frames the batch needs from one video file in one call.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset

from embodyhpc.data.decode_device import check_image_dtype
from embodyhpc.data.delta import clamp_to_episode, delta_steps
from embodyhpc.data.errors import DatasetError, SampleError
from embodyhpc.data.formats import check_lerobot_version, read_lerobot_info
from embodyhpc.data.video import DEFAULT_TOLERANCE_S, FrameDecoder, make_frame_decoder

_EPISODE_COLUMNS = ("episode_index", "dataset_from_index", "dataset_to_index", "data/chunk_index", "data/file_index")
_VIDEO_COLUMNS = ("chunk_index", "file_index", "from_timestamp")


def _read_parquet(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    try:
        table = pq.read_table(path, columns=list(columns) if columns is not None else None)
    except FileNotFoundError:
        raise DatasetError("file missing (meta/episodes names it)", where=str(path)) from None
    except (pa.ArrowException, OSError, KeyError) as exc:  # truncated, not parquet, or a named column is absent
        raise DatasetError(f"cannot read parquet: {' '.join(str(exc).split())[:300]}", where=str(path),
                           fix="restore the file from the dataset's source (it is truncated or not parquet)") from None
    return table


def _read_tasks(path: Path) -> dict[int, str]:
    table = _read_parquet(path)
    if "task" in table.column_names:
        names = table.column("task").to_pylist()
    else:
        # LeRobot writes the task string as the pandas index; its column name is in the pandas metadata.
        pandas_meta = json.loads((table.schema.metadata or {}).get(b"pandas", b"{}"))
        index_columns = [c for c in pandas_meta.get("index_columns", []) if isinstance(c, str)]
        if not index_columns or "task_index" not in table.column_names:
            raise DatasetError("expected columns task_index and task (or a pandas index of task strings)",
                               where=str(path))
        names = table.column(index_columns[0]).to_pylist()
    return dict(zip(table.column("task_index").to_pylist(), names, strict=True))


def _column_to_numpy(column: pa.ChunkedArray, num_rows: int) -> np.ndarray:
    column = column.combine_chunks()
    if pa.types.is_fixed_size_list(column.type) and not pa.types.is_nested(column.type.value_type):
        return column.flatten().to_numpy(zero_copy_only=False).reshape(num_rows, column.type.list_size)
    if pa.types.is_nested(column.type):
        return np.asarray(column.to_pylist())  # variable-length or multi-dim lists: rare, small
    return column.to_numpy(zero_copy_only=False)


class LeRobotV3Dataset(Dataset):
    """All frames of a LeRobot v3.0 dataset; item i is frame row i (its global `index`).

    Subclasses for other layouts (data/lerobot_v21.py) load the same tables (`_tasks`, `_episodes`, the frame
    columns) from their own files and override `video_path`; items are built here for every layout."""

    codebase_version = "v3.0"

    def __init__(self, root: str | os.PathLike, delta_timestamps: Mapping[str, Sequence[float]] | None = None,
                 *, video_backend: str | FrameDecoder = "auto", tolerance_s: float = DEFAULT_TOLERANCE_S,
                 image_dtype: str = "float32") -> None:
        self.root = Path(root)
        self.image_dtype = check_image_dtype(image_dtype)
        self.info = read_lerobot_info(self.root)
        check_lerobot_version(self.root, self.info, self.codebase_version)
        self.fps = int(self.info["fps"])
        self.tolerance_s = tolerance_s
        self.features: dict[str, dict[str, Any]] = self.info["features"]
        self.video_keys = [k for k, f in self.features.items() if f.get("dtype") == "video"]
        if any(f.get("dtype") == "image" for f in self.features.values()):
            raise DatasetError("features stored as images inside parquet are not supported yet (only video)",
                               where=str(self.root / "meta" / "info.json"))
        self._tasks = self._load_tasks()
        self._load_episodes()
        self._load_frames()
        self.delta_indices = delta_steps(delta_timestamps, self.features, self.fps, tolerance_s)
        self.delta_timestamps = {k: list(v) for k, v in (delta_timestamps or {}).items()}
        self.decoder = video_backend if isinstance(video_backend, FrameDecoder) else make_frame_decoder(
            video_backend, tolerance_s=tolerance_s)

    # -- metadata -------------------------------------------------------------------------------------
    def _load_tasks(self) -> dict[int, str]:
        return _read_tasks(self.root / "meta" / "tasks.parquet")

    def _load_episodes(self) -> None:
        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise DatasetError("no meta/episodes/chunk-*/file-*.parquet", where=str(self.root))
        columns = [*_EPISODE_COLUMNS, *(f"videos/{k}/{c}" for k in self.video_keys for c in _VIDEO_COLUMNS)]
        for path in files:
            try:
                names = pq.read_schema(path).names
            except (pa.ArrowException, OSError) as exc:
                raise DatasetError(f"cannot read parquet: {' '.join(str(exc).split())[:300]}", where=str(path),
                                   fix="restore the file from the dataset's source (it is truncated or not "
                                       "parquet)") from None
            missing = sorted(set(columns) - set(names))
            if missing:
                raise DatasetError(f"missing columns {missing}", where=str(path))
        table = pa.concat_tables([_read_parquet(p, columns) for p in files])
        episodes = {c: table.column(c).to_numpy() for c in columns}
        order = np.argsort(episodes["episode_index"], kind="stable")
        self._episodes = {c: v[order] for c, v in episodes.items()}
        self.num_episodes = len(order)

    def _load_frames(self) -> None:
        eps = self._episodes
        data_files = sorted(set(zip(eps["data/chunk_index"].tolist(), eps["data/file_index"].tolist(), strict=True)))
        paths = [self.root / self.info["data_path"].format(chunk_index=c, file_index=f) for c, f in data_files]
        keys = [k for k in self.features if k not in self.video_keys]
        self._set_frames(pa.concat_tables([_read_parquet(p, keys) for p in paths]), keys)

    def _set_frames(self, table: pa.Table, keys: Sequence[str]) -> None:
        """The frame columns (every non-video feature) of all data files in row order, checked against the
        episodes."""
        eps = self._episodes
        num_frames = table.num_rows
        # Columns as tensors: items index them without Python objects per row, and forked workers share them.
        self._columns = {}
        for key in keys:
            values = _column_to_numpy(table.column(key), num_frames)
            self._columns[key] = torch.from_numpy(np.require(values, requirements=["C", "W"]))  # W: own copy
        for required in ("index", "episode_index", "timestamp", "task_index"):
            if required not in self._columns:
                raise DatasetError(f"feature {required!r} missing", where=str(self.root / "meta" / "info.json"))
        if not torch.equal(self._columns["index"], torch.arange(num_frames)):
            raise DatasetError(f"frame rows are not numbered 0..{num_frames - 1} in order across data files",
                               where=str(self.root / "data"), fix="re-export the dataset with LeRobot")
        if int(eps["dataset_to_index"].max(initial=0)) != num_frames:
            raise DatasetError(f"the episodes end at row {int(eps['dataset_to_index'].max(initial=0))} but the "
                               f"data files hold {num_frames} rows", where=str(self.root))
        # Row of meta/episodes for each frame, so an item finds its episode bounds in O(1).
        episode_row = np.full(int(eps["episode_index"].max(initial=0)) + 1, -1, dtype=np.int64)
        episode_row[eps["episode_index"]] = np.arange(self.num_episodes)
        self._episode_row_of_frame = torch.from_numpy(episode_row[self._columns["episode_index"].numpy()])
        self._timestamps_s = self._columns["timestamp"].numpy().astype(np.float64)

    @property
    def num_frames(self) -> int:
        return len(self._timestamps_s)

    @property
    def tasks(self) -> dict[int, str]:
        return dict(self._tasks)

    def video_path(self, key: str, episode_row: int) -> Path:
        chunk = int(self._episodes[f"videos/{key}/chunk_index"][episode_row])
        file = int(self._episodes[f"videos/{key}/file_index"][episode_row])
        return self.root / self.info["video_path"].format(video_key=key, chunk_index=chunk, file_index=file)

    # -- items ----------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_frames

    @property
    def decode_seconds(self) -> float:
        """Seconds this process spent decoding video (the loader's decode time per sample)."""
        return self.decoder.decode_s

    def first_video_file(self) -> Path | None:
        """A video file of the dataset (what a GPU decode probe opens), or None without cameras."""
        return self.video_path(self.video_keys[0], 0) if self.video_keys and self.num_episodes else None

    def frame_locations(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(video file number, frame number inside that file) of each frame row, for the first camera (int64 arrays):
        rows with the same file and near frame numbers share decoded frames (data/gop_order.py groups them). Without
        cameras, the episode and the frame in it."""
        idx = np.asarray(indices, dtype=np.int64)
        rows = self._episode_row_of_frame.numpy()[idx]
        frames = idx - self._episodes["dataset_from_index"][rows]
        if not self.video_keys:
            return rows, frames
        key = self.video_keys[0]
        if f"videos/{key}/file_index" in self._episodes:  # v3.0: episodes share files (chunk, file)
            files = (self._episodes[f"videos/{key}/chunk_index"][rows].astype(np.int64) << 32) + \
                self._episodes[f"videos/{key}/file_index"][rows]
        else:  # v2.1: one file per episode
            files = rows
        first = np.rint(self._episodes[f"videos/{key}/from_timestamp"][rows] * self.fps).astype(np.int64)
        return files.astype(np.int64), first + frames

    def set_frame_options(self, *, image_dtype: str | None = None, decoder: FrameDecoder | None = None) -> None:
        """data.image_dtype and the decoder data.decode_device chose (data/loader.py, before the workers start)."""
        if image_dtype is not None:
            self.image_dtype = check_image_dtype(image_dtype)
        if decoder is not None:
            self.decoder.close()
            self.decoder = decoder

    def __getitem__(self, idx: int) -> dict[str, Any]:
        item, requests = self._plan(idx)
        for key, episode_row, times_s in requests:
            self._put_frames(item, key, self._decode(key, episode_row, int(item["index"]), times_s))
        return item

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """Items of a micro-batch, each equal to `self[i]`: every frame they need from one video file decoded in one
        call. A file that fails is decoded again per sample, so the error names the sample it breaks."""
        planned = [self._plan(i) for i in indices]
        by_file: dict[tuple[str, Path], list[tuple[int, int, np.ndarray]]] = {}
        for n, (_, requests) in enumerate(planned):
            for key, episode_row, times_s in requests:
                by_file.setdefault((key, self.video_path(key, episode_row)), []).append((n, episode_row, times_s))
        for (key, path), wanted in by_file.items():
            times_s = np.concatenate([t for _, _, t in wanted])
            try:
                frames = self.decoder.decode(path, times_s)
            except Exception:  # noqa: BLE001 - per sample below, where the error names its sample
                frames = None
            start = 0
            for n, episode_row, sample_times_s in wanted:
                item = planned[n][0]
                if frames is None:
                    self._put_frames(item, key, self._decode(key, episode_row, int(item["index"]), sample_times_s))
                else:
                    self._put_frames(item, key, frames[start:start + len(sample_times_s)])
                start += len(sample_times_s)
        return [item for item, _ in planned]

    def _plan(self, idx: int) -> tuple[dict[str, Any], list[tuple[str, int, np.ndarray]]]:
        """The item without its camera frames, and per camera (key, episode row, times in its video file)."""
        idx = int(idx)
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"frame {idx} out of range for a dataset of {len(self)} frames")
        episode_row = int(self._episode_row_of_frame[idx])
        first = int(self._episodes["dataset_from_index"][episode_row])
        end = int(self._episodes["dataset_to_index"][episode_row])

        # clone(): a view would drag the whole column's storage into shared memory on a worker queue.
        item: dict[str, Any] = {k: col[idx].clone() for k, col in self._columns.items()}
        rows: dict[str, np.ndarray] = {}
        for key, steps in self.delta_indices.items():
            rows[key], is_pad = clamp_to_episode(idx, steps, first, end)  # edge frames repeat, as in LeRobot
            if key in self._columns:
                item[key] = self._columns[key][torch.from_numpy(rows[key])]
            item[f"{key}_is_pad"] = torch.from_numpy(is_pad)
        requests = []
        for key in self.video_keys:
            from_s = float(self._episodes[f"videos/{key}/from_timestamp"][episode_row])
            # Stored frame timestamps (float32 in the parquet), shifted into the concatenated file.
            frame_s = self._timestamps_s[rows[key]] if key in rows else self._timestamps_s[idx:idx + 1]
            requests.append((key, episode_row, from_s + frame_s))
        item["task"] = self._tasks[int(item["task_index"])]
        return item, requests

    def _put_frames(self, item: dict[str, Any], key: str, frames: torch.Tensor) -> None:
        """Decoded uint8 (T, C, H, W) frames into the item: float32 in [0, 1] (LeRobot's), or uint8 as decoded."""
        if self.image_dtype == "float32":
            frames = frames.to(torch.float32).div_(255)
        elif frames.dtype != torch.uint8:
            raise TypeError(f"{key}: the decoder gave {frames.dtype} frames, uint8 expected")
        # LeRobot squeezes a one-frame query: a single camera offset gives (C, H, W), as no offset does
        item[key] = frames if len(frames) > 1 else frames[0]

    def _decode(self, key: str, episode_row: int, idx: int, times_s: np.ndarray) -> torch.Tensor:
        """The frames of camera `key` at `times_s`; a SampleError naming the file, episode and frame if the video
        cannot give them (truncated, corrupt, timestamps that do not match it)."""
        path = self.video_path(key, episode_row)
        try:
            return self.decoder.decode(path, times_s)
        except Exception as exc:  # noqa: BLE001 - decoders raise their own types (torchcodec, PyAV, FFmpeg)
            cause = " ".join(str(exc).split()).replace(f"{path}: ", "")
            episode = int(self._episodes["episode_index"][episode_row])
            frame = idx - int(self._episodes["dataset_from_index"][episode_row])
            raise SampleError(f"episode {episode}, frame {frame} (index {idx}): cannot decode {key} at t="
                              f"{[round(float(t), 6) for t in np.atleast_1d(times_s)]} s ({type(exc).__name__}: "
                              f"{cause[:300]})", where=str(path),
                              fix="re-encode or restore this video file, or set data.on_bad_sample=skip to train "
                                  "without the samples it breaks") from exc

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(root={str(self.root)!r}, frames={len(self)}, episodes={self.num_episodes}, "
                f"fps={self.fps}, cameras={self.video_keys}, video_backend={self.decoder.backend!r}, "
                f"image_dtype={self.image_dtype!r})")
