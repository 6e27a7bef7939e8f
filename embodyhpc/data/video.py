"""Decode video frames at timestamps: one interface, a torchcodec backend and a PyAV fallback.

A `FrameDecoder` takes one mp4 and a batch of timestamps (seconds, in the file's own time line)
and returns the frames shown at those times as a uint8 tensor (T, C, H, W). Each request is
served from a single decoder, so all frames an item needs from one file cost one seek.

Open decoders are kept in a small per-process LRU cache keyed by path. The cache remembers the
process that filled it: a decoder opened before a DataLoader fork does not survive the fork
(torchcodec reports "no more frames left to decode"), so a worker that inherits a cache from its
parent drops it and opens its own decoders on first use. The cache is also dropped on pickling,
so spawn workers start empty too.

Batched decoding: a reader that builds a whole micro-batch (LeRobotV3Dataset.__getitems__) asks each file once
for every frame the batch needs from it, in any order and with repeats: torchcodec's batch API sorts the frames,
decodes each once and seeks only where the next frame is not ahead in the stream; PyAV seeks once per run of
requested times (a new run where the next time lies more than PYAV_SEEK_GAP_S ahead, so a batch spread over a long
file is not decoded from end to end).

Devices: TorchCodecFrameDecoder(device="cuda") decodes on the GPU with torchcodec's NVDEC decoder and copies the
frames back to the host as uint8 (data/decode_device.py chooses the device and refuses cuda without a GPU).
`decode_s` is the time this process spent in `decode` (the loader's decode time per sample).

Frame lookup follows LeRobot's rule: the frame whose presentation time is nearest to the
requested time, accepted only within `tolerance_s` (default 1e-4 s, LeRobot's default);
anything further away is an error, never a silently wrong frame.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from embodyhpc.data.delta import DEFAULT_TOLERANCE_S

DEFAULT_CACHE_SIZE = 8
PYAV_SEEK_GAP_S = 0.5
"""PyAV: requested times further apart than this start a new seek (decoding forward through a gap of 0.5 s costs
about as much as a seek to the keyframe before the next time, for the GOPs LeRobot and our writer use)."""

# Decoder handles a forked child inherited from its parent. They are kept referenced, never freed: freeing
# FFmpeg state whose codec threads stayed in the parent deadlocks the child (PyAV + libdav1d, seen here).
_INHERITED_HANDLES: list[Any] = []


class VideoDecodeError(RuntimeError):
    """A requested timestamp has no frame within tolerance, or the file cannot be decoded."""


def _nearest_frames(path: Path, wanted_s: np.ndarray, found_s: np.ndarray, tolerance_s: float) -> np.ndarray:
    """Index into `found_s` of the frame nearest each wanted time; raise if one is off by > tolerance."""
    distance_s = np.abs(wanted_s[:, None] - found_s[None, :])  # (num_wanted, num_found)
    nearest = distance_s.argmin(axis=1)
    error_s = distance_s[np.arange(len(wanted_s)), nearest]
    bad = np.flatnonzero(error_s > tolerance_s)
    if bad.size:
        i = bad[0]
        raise VideoDecodeError(
            f"{path}: no frame within {tolerance_s} s of t={wanted_s[i]:.6f} s (nearest frame at "
            f"{found_s[nearest[i]]:.6f} s); the episode's video timestamps in meta/episodes do not match the "
            "video file, or the video is not constant frame rate")
    return nearest


class FrameDecoder:
    """Base class: a bounded, fork-aware cache of open per-file decoders plus `decode`."""

    backend = "base"

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE, tolerance_s: float = DEFAULT_TOLERANCE_S) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.cache_size = cache_size
        self.tolerance_s = tolerance_s
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_pid = os.getpid()
        self.decode_s = 0.0
        """Seconds this process spent in `decode` (inherited values are reset in a fresh worker: see _handle)."""

    def decode(self, path: str | os.PathLike, timestamps_s: Sequence[float]) -> torch.Tensor:
        """Frames nearest to `timestamps_s` in `path`, uint8 (T, C, H, W), in the order asked."""
        path = Path(path)
        wanted_s = np.asarray(timestamps_s, dtype=np.float64).reshape(-1)
        if wanted_s.size == 0:
            raise ValueError(f"{path}: no timestamps requested")
        started = time.perf_counter()
        try:
            return self._decode(path, self._handle(path), wanted_s)
        finally:
            self.decode_s += time.perf_counter() - started

    def _handle(self, path: Path) -> Any:
        if self._cache_pid != os.getpid():
            # Inherited through fork: these handles share a file offset with the parent's; never use them.
            _INHERITED_HANDLES.append(self._cache)
            self._cache = OrderedDict()
            self._cache_pid = os.getpid()
            self.decode_s = 0.0
        key = str(path)
        handle = self._cache.get(key)
        if handle is not None:
            self._cache.move_to_end(key)
            return handle
        if not path.is_file():
            raise VideoDecodeError(f"{path}: video file not found")
        handle = self._open(path)
        self._cache[key] = handle
        while len(self._cache) > self.cache_size:
            _, evicted = self._cache.popitem(last=False)
            self._close(evicted)
        return handle

    @property
    def num_open(self) -> int:
        """Decoders open in this process (0 in a fresh worker)."""
        return len(self._cache) if self._cache_pid == os.getpid() else 0

    def close(self) -> None:
        """Close every open decoder of this process (an unclosed PyAV container left as garbage hangs a forked
        child that collects it)."""
        if self._cache_pid != os.getpid():
            _INHERITED_HANDLES.append(self._cache)
        else:
            for handle in self._cache.values():
                self._close(handle)
        self._cache = OrderedDict()

    def __del__(self) -> None:
        if getattr(self, "_cache", None):
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = OrderedDict()
        return state

    def _open(self, path: Path) -> Any:
        raise NotImplementedError

    def _close(self, handle: Any) -> None:
        pass

    def _decode(self, path: Path, handle: Any, wanted_s: np.ndarray) -> torch.Tensor:
        raise NotImplementedError


class TorchCodecFrameDecoder(FrameDecoder):
    """torchcodec: FFmpeg on the CPU, or NVDEC on a GPU (device="cuda", "cuda:N"), whose frames come back to the
    host as uint8. `seek_mode="approximate"` skips the full-file index scan at open. `video_decoder`: the class that
    opens a file (torchcodec.decoders.VideoDecoder; tests pass a double of its CUDA decoder)."""

    backend = "torchcodec"

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE, tolerance_s: float = DEFAULT_TOLERANCE_S,
                 seek_mode: str = "approximate", device: str = "cpu", video_decoder: Any = None) -> None:
        super().__init__(cache_size, tolerance_s)
        if video_decoder is None:
            from torchcodec.decoders import VideoDecoder  # fail at construction, not in a worker

            video_decoder = VideoDecoder
        self.video_decoder = video_decoder
        self.seek_mode = seek_mode
        self.device = str(device)

    def _open(self, path: Path) -> Any:
        return self.video_decoder(str(path), seek_mode=self.seek_mode, device=self.device)

    def _decode(self, path: Path, handle: Any, wanted_s: np.ndarray) -> torch.Tensor:
        # The frame *played at* t starts at or before t; nudging by the tolerance keeps float noise in a
        # stored timestamp (3.0999999 for 3.1) from selecting the previous frame.
        end_s = handle.metadata.end_stream_seconds
        query_s = wanted_s + self.tolerance_s
        if end_s is not None:
            query_s = np.minimum(query_s, np.nextafter(end_s, -np.inf))
        try:
            batch = handle.get_frames_played_at(seconds=query_s.tolist())
        except (RuntimeError, IndexError, ValueError) as exc:
            raise VideoDecodeError(f"{path}: torchcodec could not decode t={wanted_s.tolist()}: {exc}") from exc
        _nearest_frames(path, wanted_s, batch.pts_seconds.numpy(), self.tolerance_s)
        frames = batch.data
        if frames.device.type != "cpu":
            # NVDEC's frames are on the GPU: back to the host, uint8 (a fraction of the bytes the decode saves),
            # so the workers' collate, shared memory and pinning are the same for every decode device.
            frames = frames.cpu()
        return frames


class PyAVFrameDecoder(FrameDecoder):
    """PyAV (its own bundled FFmpeg): seek to the keyframe before the first time, decode forward."""

    backend = "pyav"

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE, tolerance_s: float = DEFAULT_TOLERANCE_S) -> None:
        super().__init__(cache_size, tolerance_s)
        import av  # noqa: F401

    def _open(self, path: Path) -> Any:
        import av

        return av.open(str(path))

    def _close(self, handle: Any) -> None:
        handle.close()

    def _decode(self, path: Path, handle: Any, wanted_s: np.ndarray) -> torch.Tensor:
        """One seek per run of requested times (see PYAV_SEEK_GAP_S); frames in the order asked."""
        order = np.argsort(wanted_s, kind="stable")
        ordered = wanted_s[order]
        starts = np.flatnonzero(np.diff(ordered) > PYAV_SEEK_GAP_S) + 1
        out = torch.empty(0, dtype=torch.uint8)
        for run in np.split(np.arange(len(ordered)), starts):
            frames = self._decode_run(path, handle, ordered[run])
            if out.numel() == 0:
                out = torch.empty((len(wanted_s), *frames.shape[1:]), dtype=torch.uint8)
            out[torch.from_numpy(order[run])] = frames
        return out

    def _decode_run(self, path: Path, handle: Any, wanted_s: np.ndarray) -> torch.Tensor:
        stream = handle.streams.video[0]
        time_base = float(stream.time_base)
        first_s, last_s = wanted_s.min() - self.tolerance_s, wanted_s.max() + self.tolerance_s
        handle.seek(max(0, int(first_s / time_base)), stream=stream, backward=True, any_frame=False)
        # Keep the frames inside the window plus one on each side, so a miss reports the nearest frame.
        frames, found_s = [], []
        for frame in handle.decode(stream):
            frame_s = frame.pts * time_base
            if frame_s < first_s:
                frames, found_s = [frame], [frame_s]
                continue
            frames.append(frame)
            found_s.append(frame_s)
            if frame_s > last_s:
                break
        if not frames:
            raise VideoDecodeError(f"{path}: no frames decoded at or after {first_s:.6f} s")
        nearest = _nearest_frames(path, wanted_s, np.asarray(found_s), self.tolerance_s)
        rgb = {i: frames[i].to_ndarray(format="rgb24") for i in set(nearest.tolist())}  # (H, W, 3) uint8
        hwc = torch.from_numpy(np.stack([rgb[i] for i in nearest]))
        return hwc.permute(0, 3, 1, 2).contiguous()


BACKENDS = {"torchcodec": TorchCodecFrameDecoder, "pyav": PyAVFrameDecoder}


def make_frame_decoder(backend: str = "auto", **kwargs: Any) -> FrameDecoder:
    """`backend`: "torchcodec", "pyav", or "auto" (torchcodec when it imports, else PyAV)."""
    if backend == "auto":
        try:
            return TorchCodecFrameDecoder(**kwargs)
        except (ImportError, OSError, RuntimeError):
            # torchcodec raises RuntimeError/OSError when FFmpeg's shared libraries are missing.
            backend = "pyav"
    if backend not in BACKENDS:
        raise ValueError(f"unknown video backend {backend!r}; choose one of: auto, {', '.join(BACKENDS)}")
    return BACKENDS[backend](**kwargs)
