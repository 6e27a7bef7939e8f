"""`embodyhpc data convert SRC --to v3.0 --out DST`: a LeRobot v2.1 folder rewritten as LeRobot v3.0, no value changed.

    from embodyhpc.data.convert import convert_v21_to_v30
    summary = convert_v21_to_v30("/data/pusht_v21", "/data/pusht")   # the v3.0 reader gives the same items

What is written (the layout of data/writer.py, which LeRobot 0.4 reads):
- data: every episode's rows as stored (same columns, types and values, `index` and `timestamp` included), appended
  into data/chunk-CCC/file-FFF.parquet files of about `data_file_size_mb`;
- videos: each camera's episode files joined into videos/<camera>/chunk-CCC/file-FFF.mp4 by copying their
  compressed packets (no re-encoding: every decoded pixel stays what it was), each episode's packets shifted to
  start where the previous episode ended, and meta/episodes records that start as the episode's from_timestamp.
  An episode whose video cannot be joined exactly (another codec, size or codec setup than the open file, frames
  stored out of display order, a first frame not at 0) gets a file of its own, a byte copy of its mp4;
- meta/tasks.parquet with the source's task indices, meta/episodes with LeRobot v3.0's columns, meta/info.json;
- meta/stats.json: cameras as LeRobot aggregates episodes_stats.jsonl (what its v2.1 reader uses); numeric features
  computed over every frame (min, max, mean, std, count: equal to that aggregate up to rounding) plus the quantiles
  q01..q99 that v2.1 files lack (quantile normalisation needs q01 and q99).

Checked before anything is written: SRC is a v2.1 folder whose metadata and data files are consistent (the reader's
checks), DST a new path or an empty folder. The folder is written in place with data/writer.py's marker file and
meta/info.json last; a conversion that fails removes what it wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from embodyhpc.data.errors import DatasetError
from embodyhpc.data.formats import LEROBOT_CODEBASE_VERSION, read_lerobot_info
from embodyhpc.data.output_dir import WRITING_MARKER, check_output_dir, display_path
from embodyhpc.data.v21_meta import (
    CODEBASE_VERSION as V21,
)
from embodyhpc.data.v21_meta import (
    episode_path,
    read_episode_table,
    read_episodes,
    read_episodes_stats,
    read_tasks,
    v21_stats,
)
from embodyhpc.data.writer import (
    DATA_PATH,
    EPISODES_PATH,
    VIDEO_PATH,
    _next_file,
    _numeric_stats,
    write_episodes_parquet,
    write_tasks_parquet,
)

CONVERT_TARGETS = ("v3.0",)
# info.json keys of v2.1 that v3.0 does not have (its totals of chunks and videos, the per-episode templates)
_V21_ONLY_INFO = ("total_chunks", "total_videos", "data_path", "video_path")


@dataclass(frozen=True)
class ConvertSummary:
    root: Path
    num_episodes: int
    num_frames: int
    video_files: int
    """mp4 files written over all cameras (one per camera when every episode could be joined)."""
    size_bytes: int
    wall_s: float


def check_convert_source(src: str | os.PathLike, key: str = "SRC") -> tuple[Path, dict[str, Any]]:
    """SRC as a v2.1 folder and its info.json; a one-line DatasetError otherwise."""
    root = Path(src)
    if not str(src).strip():
        raise DatasetError("empty path", key=key, fix="name a LeRobot v2.1 dataset folder")
    if not root.is_dir():
        raise DatasetError("not a folder" if root.exists() else "does not exist", where=display_path(root), key=key,
                           fix="name a LeRobot v2.1 dataset folder")
    info = read_lerobot_info(root)
    version = info.get("codebase_version")
    if version != V21:
        hint = ("it is already v3.0: read it as it is" if version == LEROBOT_CODEBASE_VERSION else
                "a v2.0 folder goes to v2.1 with LeRobot 0.3's lerobot.datasets.v21.convert_dataset_v20_to_v21 first"
                if version == "v2.0" else "only v2.1 folders are converted")
        raise DatasetError(f"codebase_version {str(version)[:20]!r}, not {V21!r}",
                           where=str(root / "meta" / "info.json"), key=key, fix=hint)
    if not isinstance(info.get("fps"), int) or not isinstance(info.get("features"), dict):
        raise DatasetError("fps (a whole number) or features missing", where=str(root / "meta" / "info.json"), key=key)
    images = [k for k, f in info["features"].items() if isinstance(f, dict) and f.get("dtype") == "image"]
    if images:
        raise DatasetError(f"features stored as images inside parquet ({', '.join(images)}) are not converted "
                           "(only video)", where=str(root / "meta" / "info.json"), key=key)
    return root, info


def check_convert_output(out: str | os.PathLike) -> None:
    """DST can take the new folder: a new path or an empty folder (a conversion never replaces one)."""
    try:
        check_output_dir(out, overwrite=False, key="--out")
    except DatasetError as exc:
        if exc.fix and "--overwrite" in exc.fix:
            raise DatasetError(exc.message, where=exc.where, key=exc.key,
                               fix="pick a new path or an empty folder: a conversion replaces nothing") from None
        raise


def convert_v21_to_v30(src: str | os.PathLike, out: str | os.PathLike, *, data_file_size_mb: float = 100,
                       video_file_size_mb: float = 200) -> ConvertSummary:
    """Write the v2.1 folder `src` as a new v3.0 folder `out` (see the module docstring)."""
    started = time.monotonic()
    root, info = check_convert_source(src)
    check_convert_output(out)
    episodes = read_episodes(root)
    tasks = read_tasks(root)
    features = info["features"]
    video_keys = [k for k, f in features.items() if f.get("dtype") == "video"]
    columns = [k for k in features if k not in video_keys]
    sources = {k: [episode_path(root, info, "video_path", e.index, video_key=k) for e in episodes] for k in video_keys}
    missing = next((p for paths in sources.values() for p in paths if not p.is_file()), None)
    if missing is not None:
        raise DatasetError("video file missing (meta/episodes.jsonl lists its episode)", where=str(missing))
    camera_stats = {k: v for k, v in v21_stats(root).items() if k in video_keys}
    if set(read_episodes_stats(root)) != {e.index for e in episodes}:
        raise DatasetError("does not hold one line per episode of meta/episodes.jsonl",
                           where=str(root / "meta" / "episodes_stats.jsonl"))

    for episode in episodes:  # the row counts from the parquet footers, before anything is written
        _check_rows(episode_path(root, info, "data_path", episode.index), episode.index, episode.length)

    dst = Path(out)
    made = [p for p in (dst, *dst.parents) if not p.exists()]  # the folders this call creates, innermost first
    dst.mkdir(parents=True, exist_ok=True)
    (dst / WRITING_MARKER).touch()
    try:
        writer = _V30Writer(dst, info, columns, video_keys, data_file_size_mb, video_file_size_mb)
        for episode in episodes:
            table = read_episode_table(root, info, episode.index, episode.length, columns)
            writer.add(episode.index, episode.tasks, table, {k: sources[k][episode.index] for k in video_keys})
        writer.finish(tasks, camera_stats)
    except BaseException:
        writer_videos = locals().get("writer")
        if writer_videos is not None:
            writer_videos.abort()
        if made:
            shutil.rmtree(made[-1], ignore_errors=True)
        else:  # the empty folder it was given: empty again
            for child in dst.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        raise
    size = sum(p.stat().st_size for p in dst.rglob("*") if p.is_file())
    return ConvertSummary(dst, len(episodes), writer.num_frames, writer.video_files, size,
                          time.monotonic() - started)


def _check_rows(path: Path, episode: int, length: int) -> None:
    try:
        rows = pq.read_metadata(path).num_rows
    except FileNotFoundError:
        raise DatasetError(f"file missing (meta/episodes.jsonl lists episode {episode})", where=str(path)) from None
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"cannot read parquet: {' '.join(str(exc).split())[:300]}", where=str(path)) from None
    if rows != length:
        raise DatasetError(f"holds {rows} frames; meta/episodes.jsonl gives episode {episode} length {length}",
                           where=str(path))


class _VideoJoiner:
    """One camera's output mp4 files: an episode's packets are appended to the open file when that is exact."""

    def __init__(self, root: Path, key: str, size_mb: float, chunks_size: int) -> None:
        self.root, self.key, self.size_mb, self.chunks_size = root, key, size_mb, chunks_size
        self.file = (0, 0)
        self.files_written = 0
        self._out: Any = None  # (container, stream, signature, end pts) of the open file

    def _path(self) -> Path:
        return self.root / VIDEO_PATH.format(video_key=self.key, chunk_index=self.file[0], file_index=self.file[1])

    def add(self, source: Path) -> dict[str, Any]:
        """Append `source` (one episode's mp4); its meta/episodes columns for this camera."""
        import av

        try:
            container = av.open(str(source))
            stream = container.streams.video[0]
            packets = [p for p in container.demux(stream) if p.size]
        except (av.FFmpegError, OSError, IndexError) as exc:
            raise DatasetError(f"cannot read the video ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})",
                               where=str(source), fix="restore the file from the dataset's source") from None
        with container:
            context = stream.codec_context
            signature = (context.name, stream.width, stream.height, context.format and context.format.name,
                         bytes(context.extradata or b""), stream.time_base)
            joinable = bool(packets) and packets[0].pts == 0 and all(p.pts == p.dts for p in packets)
            if self._out is not None and (not joinable or self._out[2] != signature or self._full()):
                self._close()
            if not joinable:  # a file of its own, byte for byte: exact whatever its timing
                path = self._path()
                path.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, path)
                columns = self._columns(0.0, _duration_s(stream, packets))
                self.files_written += 1
                self._advance()
                return columns
            if self._out is None:
                self._open(stream, signature)
            out, out_stream, _, offset = self._out
            end = offset
            for packet in packets:
                packet.pts += offset
                packet.dts += offset
                end = max(end, packet.pts + (packet.duration or 0))
                packet.stream = out_stream
                out.mux(packet)
            self._out = (out, out_stream, signature, end)
            return self._columns(float(offset * stream.time_base), float(end * stream.time_base))

    def _columns(self, from_s: float, to_s: float) -> dict[str, Any]:
        return {f"videos/{self.key}/chunk_index": self.file[0], f"videos/{self.key}/file_index": self.file[1],
                f"videos/{self.key}/from_timestamp": from_s, f"videos/{self.key}/to_timestamp": to_s}

    def _open(self, stream: Any, signature: tuple) -> None:
        import av

        path = self._path()
        path.parent.mkdir(parents=True, exist_ok=True)
        out = av.open(str(path), mode="w")
        out_stream = out.add_stream_from_template(stream, opaque=True)  # remux: no encoder
        out_stream.time_base = stream.time_base
        self._out = (out, out_stream, signature, 0)
        self.files_written += 1

    def _full(self) -> bool:
        return self._path().stat().st_size >= self.size_mb * 1e6

    def _advance(self) -> None:
        self.file = _next_file(*self.file, self.chunks_size)

    def _close(self) -> None:
        if self._out is not None:
            self._out[0].close()
            self._out = None
            self._advance()

    def close(self) -> None:
        self._close()

    def abort(self) -> None:
        if self._out is not None:
            try:
                self._out[0].close()
            except Exception:  # noqa: BLE001 - best effort: the error that stopped the conversion is on its way
                pass
            self._out = None


def _duration_s(stream: Any, packets: list) -> float:
    if not packets:
        return 0.0
    return float(max(p.pts + (p.duration or 0) for p in packets if p.pts is not None) * stream.time_base)


class _V30Writer:
    def __init__(self, root: Path, info: dict[str, Any], columns: list[str], video_keys: list[str],
                 data_file_size_mb: float, video_file_size_mb: float) -> None:
        self.root, self.info, self.columns, self.video_keys = root, info, columns, video_keys
        self.data_file_size_mb, self.video_file_size_mb = data_file_size_mb, video_file_size_mb
        self.chunks_size = int(info.get("chunks_size") or 1000)
        self.num_frames = 0
        self._rows: list[dict[str, Any]] = []
        self._pending: list[pa.Table] = []
        self._data_file = (0, 0)
        self._data_files: list[Path] = []
        self._videos = {k: _VideoJoiner(root, k, video_file_size_mb, self.chunks_size) for k in video_keys}

    @property
    def video_files(self) -> int:
        return sum(v.files_written for v in self._videos.values())

    def add(self, episode: int, tasks: tuple[str, ...], table: pa.Table, videos: dict[str, Path]) -> None:
        length = table.num_rows
        row: dict[str, Any] = {"episode_index": episode, "tasks": list(tasks), "length": length}
        row["data/chunk_index"], row["data/file_index"] = self._data_file
        row["dataset_from_index"], row["dataset_to_index"] = self.num_frames, self.num_frames + length
        self._pending.append(table)
        for key in self.video_keys:
            row.update(self._videos[key].add(videos[key]))
        row["meta/episodes/chunk_index"], row["meta/episodes/file_index"] = 0, 0
        self._rows.append(row)
        self.num_frames += length
        if sum(t.nbytes for t in self._pending) >= self.data_file_size_mb * 1e6:
            self._flush()

    def abort(self) -> None:
        for joiner in self._videos.values():
            joiner.abort()

    def _flush(self) -> None:
        if not self._pending:
            return
        path = self.root / DATA_PATH.format(chunk_index=self._data_file[0], file_index=self._data_file[1])
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.concat_tables(self._pending).combine_chunks(), path)
        self._data_files.append(path)
        self._pending = []
        self._data_file = _next_file(*self._data_file, self.chunks_size)

    def finish(self, tasks: dict[int, str], camera_stats: dict[str, dict[str, list]]) -> None:
        self._flush()
        for joiner in self._videos.values():
            joiner.close()
        meta = self.root / "meta"
        write_episodes_parquet(self.root / EPISODES_PATH.format(chunk_index=0, file_index=0), self._rows)
        write_tasks_parquet(meta / "tasks.parquet", {task: index for index, task in tasks.items()})
        (meta / "stats.json").write_text(json.dumps({**self._numeric_stats(), **camera_stats}, indent=4))
        info = {k: v for k, v in self.info.items() if k not in _V21_ONLY_INFO}
        info.update({"codebase_version": LEROBOT_CODEBASE_VERSION, "total_episodes": len(self._rows),
                     "total_frames": self.num_frames, "total_tasks": len(tasks), "chunks_size": self.chunks_size,
                     "data_files_size_in_mb": self.data_file_size_mb,
                     "video_files_size_in_mb": self.video_file_size_mb,
                     "splits": {"train": f"0:{len(self._rows)}"}, "data_path": DATA_PATH,
                     "video_path": VIDEO_PATH if self.video_keys else None, "features": self.info["features"]})
        (meta / "info.json").write_text(json.dumps(info, indent=4))  # last: marks the folder complete
        (self.root / WRITING_MARKER).unlink()

    def _numeric_stats(self) -> dict[str, dict[str, list]]:
        stats = {}
        for key in self.columns:
            column = pa.concat_tables([pq.read_table(p, columns=[key]) for p in self._data_files]).column(key)
            values = column.combine_chunks()
            if pa.types.is_fixed_size_list(values.type) and not pa.types.is_nested(values.type.value_type):
                array = values.flatten().to_numpy(zero_copy_only=False).reshape(len(values), values.type.list_size)
            elif pa.types.is_nested(values.type):
                array = np.asarray(values.to_pylist()).reshape(len(values), -1)
            else:
                array = values.to_numpy(zero_copy_only=False).reshape(-1, 1)
            if array.dtype.kind not in "biuf":
                continue  # strings and the like: nothing to normalise
            stats[key] = _numeric_stats(array)
        return stats
