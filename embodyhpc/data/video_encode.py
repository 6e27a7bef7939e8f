"""Encoding camera frames into mp4 files as LeRobot datasets hold them (PyAV): the codec settings (VideoOptions) and
one open file per camera (VideoFileWriter). The dataset writer (data/writer.py) and recorded evaluation episodes
(eval/rollout.py) use them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

# codec name in info.json -> (PyAV encoder, default CRF, default preset). AV1 settings are LeRobot's defaults.
# CRF 18 for h264, not FFmpeg's 23: small robot images lose detail fast (64 px MetaWorld renders: mean error
# 6.1 grey levels at 23, 4.9 at 18, 3.0 from yuv420p alone; AV1 at 30: 4.4), and the files stay small.
_ENCODERS = {"h264": ("libx264", 18, "veryfast"), "av1": ("libsvtav1", 30, "12")}
# libx264's --tune values (x264 --fullhelp). "fastdecode" (CAVLC instead of CABAC, no deblocking, no weighted
# prediction) halves the CPU a reader spends per random-access frame on small robot images (96 px, CRF 18: 0.09 vs
# 0.20 ms per frame with torchcodec, bench/README.md), for files about 17 % larger at the same error.
_X264_TUNES = ("film", "animation", "grain", "stillimage", "psnr", "ssim", "fastdecode", "zerolatency")


@dataclass(frozen=True)
class VideoOptions:
    """How camera frames are encoded."""

    codec: str = "h264"
    """"h264" (libx264, fast to encode) or "av1" (libsvtav1, smaller files; LeRobot's default)."""
    gop_size: int = 2
    """Frames between keyframes. Short GOPs make random access cheap; 1 = every frame a keyframe."""
    crf: int | None = None
    """Constant rate factor (lower = better quality, bigger files); None: 18 for h264, 30 for av1."""
    preset: str | None = None
    """Encoder speed preset; None: "veryfast" for libx264, "12" for libsvtav1."""
    pix_fmt: str = "yuv420p"
    """Pixel format stored in the file; yuv420p is what every decoder handles (needs even width and height)."""
    tune: str | None = None
    """h264 only: libx264's --tune, e.g. "fastdecode" for files that training reads many times (about 2x cheaper to
    decode, about 17 % larger); None: libx264's default (CABAC, deblocking)."""

    def __post_init__(self) -> None:
        if self.codec not in _ENCODERS:
            raise ValueError(f"video codec {self.codec!r} is not supported; choose one of: {', '.join(_ENCODERS)}")
        if self.tune is not None and (self.codec != "h264" or self.tune not in _X264_TUNES):
            raise ValueError(f"video tune {self.tune!r} is not supported for codec {self.codec!r}; tune applies to "
                             f"h264 only, one of: {', '.join(_X264_TUNES)}")
        if self.gop_size < 1:
            raise ValueError(f"gop_size must be >= 1, got {self.gop_size}")

    @property
    def encoder_options(self) -> dict[str, str]:
        _, default_crf, default_preset = _ENCODERS[self.codec]
        options = {"crf": str(self.crf if self.crf is not None else default_crf),
                   "preset": self.preset or default_preset}
        if self.codec == "h264":
            options["bf"] = "0"  # no B-frames: decode order = display order, a seek never waits on a later frame
        if self.tune is not None:
            options["tune"] = self.tune
        return options



class VideoFileWriter:
    """One open mp4 of one camera: frames are encoded as they arrive; `num_frames` counts what the file holds."""

    def __init__(self, path: Path, width: int, height: int, fps: int, options: VideoOptions) -> None:
        import av

        if options.codec == "av1":
            os.environ.setdefault("SVT_LOG", "1")  # else SVT-AV1 prints a 20-line banner per file to stderr
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.num_frames = 0
        self._time_base = Fraction(1, fps)
        self._container = av.open(str(path), mode="w")
        self._stream = self._container.add_stream(_ENCODERS[options.codec][0], rate=fps,
                                                  options=options.encoder_options)
        self._stream.width, self._stream.height, self._stream.pix_fmt = width, height, options.pix_fmt
        self._stream.codec_context.gop_size = options.gop_size
        self._stream.codec_context.time_base = self._time_base

    def write(self, frames: np.ndarray) -> None:
        """frames: uint8 (T, H, W, 3) RGB."""
        import av

        for frame_rgb in frames:
            frame = av.VideoFrame.from_ndarray(frame_rgb, format="rgb24")
            frame.pts, frame.time_base = self.num_frames, self._time_base
            self._container.mux(self._stream.encode(frame))
            self.num_frames += 1

    def size_bytes(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def close(self) -> None:
        self._container.mux(self._stream.encode(None))  # flush frames the encoder still holds
        self._container.close()
