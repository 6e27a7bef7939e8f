"""`embodyhpc smoke`'s video decode rows: the training samples per second one DataLoader worker decodes on this node,
on the CPU (FFmpeg, one thread) and on the GPU (torchcodec's NVDEC decoder, data.decode_device=cuda), for each codec.

The GPU half goes through the seam training uses (data/decode_device.py: resolve_decode_device, frame_decoder_for):
where a run would refuse data.decode_device=cuda (no GPU, torchcodec's CPU build, a codec NVDEC cannot open), the row
says why instead of a number. Tests pass a double of torchcodec's CUDA decoder (`video_decoder`), so every line here
runs on a CPU.

What is measured: a clip written here as a LeRobot camera is (data/video_encode.py: the codec, a GOP of 2,
CLIP_SIZE pixels square at CLIP_FPS), then batches read as the training loader reads them: BATCH random samples of
FRAMES_PER_SAMPLE consecutive frames (a 2-frame history), every frame of a batch in one decode call (batched decoding,
data/video.py). samples/s = samples of the timed batches / the seconds their decode calls took; one untimed batch
first (opening the file; on the GPU, creating the decoder's CUDA context).

Runs in a process of its own from smoke (`python -m embodyhpc.data.decode_bench`, `run_isolated`), as each smoke row
does: a decoder that crashes or hangs fails this row only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CODECS = ("h264", "av1")
CLIP_SIZE = 256  # LIBERO's cameras; pi0.5 resizes to 224
CLIP_FPS = 30
CLIP_FRAMES = 300
FRAMES_PER_SAMPLE = 2
BATCH = 32
TIMED_BATCHES = 6
TIMEOUT_S = 600


@dataclass
class CodecRates:
    """One codec's samples/s per worker: the CPU decoder's, and the GPU's or why there is none."""

    codec: str
    cpu_backend: str
    cpu_samples_per_s: float
    cuda_samples_per_s: float | None = None
    cuda_reason: str | None = None
    """Why the GPU did not decode (the refusal data.decode_device=cuda would get on this node); None when it did."""


@dataclass
class DecodeBench:
    """What smoke.json holds under "decode" and the table prints."""

    status: str  # measured, failed
    reason: str | None = None
    clip: str = ""
    frames_per_sample: int = FRAMES_PER_SAMPLE
    batch: int = BATCH
    codecs: list[CodecRates] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def write_clip(folder: Path, codec: str, *, size: int = CLIP_SIZE, fps: int = CLIP_FPS,
               frames: int = CLIP_FRAMES) -> Path:
    """An mp4 of `frames` frames as the dataset writer encodes a camera: a moving gradient and square with a little
    seeded noise (content a codec must work for, the same every time)."""
    from embodyhpc.data.video_encode import VideoFileWriter, VideoOptions

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    writer = VideoFileWriter(Path(folder) / f"{codec}.mp4", size, size, fps, VideoOptions(codec=codec))
    try:
        for i in range(frames):
            frame = np.stack([(x + 3 * i) % 256, (y + 2 * i) % 256, (x + y) // 2 % 256], axis=-1).astype(np.uint8)
            corner = (5 * i) % max(size - size // 4, 1)
            frame[corner:corner + size // 4, corner:corner + size // 4] = 255 - frame[0, 0]
            noise = rng.integers(0, 8, size=frame.shape, dtype=np.uint8)
            writer.write(np.minimum(frame.astype(np.int16) + noise, 255).astype(np.uint8)[None])
    finally:
        writer.close()
    return writer.path


def batch_times(num_frames: int, fps: int, *, batches: int, batch: int, frames_per_sample: int,
                seed: int = 0) -> list[np.ndarray]:
    """Each batch's timestamps (seconds): `batch` samples at random frames, each `frames_per_sample` consecutive
    frames ending there, in sample order (what one decode call per file per batch asks for)."""
    if num_frames < frames_per_sample:
        raise ValueError(f"a clip of {num_frames} frames has no sample of {frames_per_sample} frames")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        last = rng.integers(frames_per_sample - 1, num_frames, size=batch)
        frames = last[:, None] - np.arange(frames_per_sample - 1, -1, -1)[None, :]
        out.append(frames.reshape(-1) / fps)
    return out


def samples_per_s(decoder: Any, path: Path, times: Sequence[np.ndarray], *, frames_per_sample: int,
                  clock: Callable[[], float] = time.perf_counter) -> float:
    """Samples per second `decoder` (a data/video.py FrameDecoder) decodes `path` at: times[0] untimed (warm-up), the
    rest one decode call per batch, frames back on the host."""
    if len(times) < 2:
        raise ValueError("needs a warm-up batch and at least one timed batch")
    decoder.decode(path, times[0])
    seconds, samples = 0.0, 0
    for wanted in times[1:]:
        started = clock()
        frames = decoder.decode(path, wanted)
        seconds += clock() - started
        if frames.shape[0] != len(wanted) or frames.device.type != "cpu":
            raise RuntimeError(f"{path}: asked {len(wanted)} frames, got {tuple(frames.shape)} on {frames.device}")
        samples += len(wanted) // frames_per_sample
    return samples / seconds if seconds > 0 else float("inf")


def measure(folder: Path, *, codecs: Sequence[str] = CODECS, size: int = CLIP_SIZE, fps: int = CLIP_FPS,
            frames: int = CLIP_FRAMES, batch: int = BATCH, timed_batches: int = TIMED_BATCHES,
            frames_per_sample: int = FRAMES_PER_SAMPLE, video_decoder: Any = None,
            clock: Callable[[], float] = time.perf_counter) -> DecodeBench:
    """CPU and GPU samples/s per worker for each codec (clips written under `folder`). `video_decoder`: the class
    torchcodec's CUDA decoder is (tests: its double)."""
    from embodyhpc.data.decode_device import frame_decoder_for, resolve_decode_device
    from embodyhpc.errors import ConfigError

    report = DecodeBench("measured", clip=f"{size}x{size} at {fps} fps, {frames} frames, GOP 2",
                         frames_per_sample=frames_per_sample, batch=batch)
    times = batch_times(frames, fps, batches=timed_batches + 1, batch=batch, frames_per_sample=frames_per_sample)
    for codec in codecs:
        clip = write_clip(folder, codec, size=size, fps=fps, frames=frames)
        cpu = frame_decoder_for("cpu")
        rates = CodecRates(codec, cpu.backend, samples_per_s(cpu, clip, times, frames_per_sample=frames_per_sample,
                                                             clock=clock))
        try:
            device = resolve_decode_device("cuda", probe=clip, video_decoder=video_decoder)
        except ConfigError as refused:
            rates.cuda_reason = refused.message.removeprefix("cuda cannot decode here: ")
        else:
            gpu = frame_decoder_for(device, video_decoder=video_decoder)
            rates.cuda_samples_per_s = samples_per_s(gpu, clip, times, frames_per_sample=frames_per_sample,
                                                     clock=clock)
        report.codecs.append(rates)
    return report


def run_isolated(options: dict | None = None, *, timeout_s: float = TIMEOUT_S) -> dict:
    """`measure` in a process of its own (keyword `options` as JSON); a failed or hung process is a failed bench with
    its last line of stderr."""
    try:
        proc = subprocess.run([sys.executable, "-m", "embodyhpc.data.decode_bench", json.dumps(options or {})],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return DecodeBench("failed", f"timed out after {timeout_s:g} s").as_dict()
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return DecodeBench("failed", f"exit {proc.returncode}: {tail[:300]}").as_dict()
    return json.loads(lines[-1])


def format_lines(bench: dict | None) -> list[str]:
    """The smoke table's lines for a bench (smoke.json's "decode")."""
    if not bench:
        return []
    if bench["status"] != "measured":
        return [f"video decode: {bench['status']}: {bench['reason']}"]
    lines = [f"video decode, samples/s per worker ({bench['clip']}; {bench['frames_per_sample']} frames per sample, "
             f"batches of {bench['batch']}):"]
    for rates in bench["codecs"]:
        gpu = rates["cuda_samples_per_s"]
        cuda = (f"cuda {gpu:,.0f} ({gpu / rates['cpu_samples_per_s']:.1f}x the cpu)" if gpu is not None
                else f"cuda -: {rates['cuda_reason']}")
        lines.append(f"  {rates['codec']:<5} cpu {rates['cpu_samples_per_s']:,.0f} ({rates['cpu_backend']}), {cuda}")
    return lines


def _main(argv: list[str]) -> int:
    options = json.loads(argv[0]) if argv else {}
    with tempfile.TemporaryDirectory() as folder:
        print(json.dumps(measure(Path(folder), **options).as_dict()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
