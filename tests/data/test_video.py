"""Frame decoders: torchcodec and PyAV agree frame by frame; tolerance and cache bounds hold."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from embodyhpc.data.video import (
    PyAVFrameDecoder,
    TorchCodecFrameDecoder,
    VideoDecodeError,
    make_frame_decoder,
)

CAMERAS = ["observation.images.top", "observation.images.wrist"]
NUM_FRAMES, FPS = 120, 10


def video(sample_root, camera: str):
    return sample_root / "videos" / camera / "chunk-000" / "file-000.mp4"


@pytest.mark.parametrize("camera", CAMERAS)
def test_torchcodec_and_pyav_agree_on_every_frame(sample_root, camera):
    # Shuffled, with repeats and float32-rounded times, as dataset items ask for them.
    rng = np.random.default_rng(0)
    frame_numbers = np.concatenate([np.arange(NUM_FRAMES), rng.integers(0, NUM_FRAMES, 20)])
    times_s = (frame_numbers / FPS).astype(np.float32).astype(np.float64)
    fast = TorchCodecFrameDecoder().decode(video(sample_root, camera), times_s)
    fallback = PyAVFrameDecoder().decode(video(sample_root, camera), times_s)
    assert fast.shape == fallback.shape == (len(times_s), 3, 48, 48)
    assert fast.dtype == fallback.dtype == torch.uint8
    # Both decode AV1 with libdav1d, but through different FFmpeg builds: allow 2 grey levels.
    assert (fast.int() - fallback.int()).abs().max() <= 2
    # Repeated requests give identical frames, and distinct frames really differ.
    first_repeat = len(frame_numbers) - 20
    assert torch.equal(fast[first_repeat], fast[frame_numbers[first_repeat]])
    assert not torch.equal(fast[0], fast[1])


@pytest.mark.parametrize("decoder_class", [TorchCodecFrameDecoder, PyAVFrameDecoder])
def test_time_between_frames_is_an_error(sample_root, decoder_class):
    with pytest.raises(VideoDecodeError, match="no frame within"):
        decoder_class().decode(video(sample_root, CAMERAS[0]), [0.35])


@pytest.mark.parametrize("decoder_class", [TorchCodecFrameDecoder, PyAVFrameDecoder])
def test_cache_is_bounded_and_dropped_on_pickle(sample_root, decoder_class):
    decoder = decoder_class(cache_size=1)
    for camera in CAMERAS:
        decoder.decode(video(sample_root, camera), [0.0])
    assert decoder.num_open == 1
    assert pickle.loads(pickle.dumps(decoder)).num_open == 0


def test_make_frame_decoder():
    assert make_frame_decoder().backend == "torchcodec"
    assert make_frame_decoder("pyav").backend == "pyav"
    with pytest.raises(ValueError, match="auto, torchcodec, pyav"):
        make_frame_decoder("nvdec")


@pytest.fixture(scope="module")
def large_video(tmp_path_factory):
    """A noise video of ~1 MB: much larger than FFmpeg's read buffer, so decoders really share a file offset."""
    import av

    path = tmp_path_factory.mktemp("video") / "noise.mp4"
    rng = np.random.default_rng(0)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        stream.codec_context.gop_size = 5
        for _ in range(100):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


class _FramePairs(torch.utils.data.Dataset):
    def __init__(self, decoder, path) -> None:
        self.decoder, self.path = decoder, path

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.decoder.decode(self.path, [(i * 37 % 100) / FPS, (i * 53 + 5) % 100 / FPS])


@pytest.mark.parametrize("decoder_class", [TorchCodecFrameDecoder, PyAVFrameDecoder])
def test_decoder_opened_before_fork_is_not_reused_in_workers(large_video, decoder_class):
    # Without the per-process cache, forked workers share the parent's decoder and file offset and
    # silently return wrong frames (seen: 237 grey levels off with torchcodec).
    dataset = _FramePairs(decoder_class(), large_video)
    want = [dataset[i] for i in range(len(dataset))]  # opens the decoder in the parent
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
    got = [pair for batch in loader for pair in batch.unbind(0)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _x264_settings(path) -> bytes:
    """The encoder settings libx264 records in the stream (its SEI user-data string "x264 - core ... options: ...")."""
    data = path.read_bytes()
    start = data.index(b"options: ")
    return data[start:data.index(b"\x00", start)]


def _write_tuned(folder, tune):
    """32 smooth 32x32 frames, each 4 grey levels brighter than the one before: a frame from a neighbouring time is
    off by >= 4 levels everywhere, the encoding by about one."""
    from embodyhpc.data.video_encode import VideoFileWriter, VideoOptions

    gradient = np.add.outer(np.arange(32), np.arange(32))[None, :, :, None]
    frames = (20 + 4 * np.arange(32)[:, None, None, None] + gradient + np.zeros((1, 1, 1, 3), int)).astype(np.uint8)
    path = folder / f"{tune}.mp4"
    writer = VideoFileWriter(path, 32, 32, FPS, VideoOptions(tune=tune))
    writer.write(frames)
    writer.close()
    return path, frames


TUNED_FRAMES = [5, 4, 17, 30, 4]


def test_h264_tune_reaches_the_encoder_and_frames_stay_at_their_times(tmp_path):
    plain, _ = _write_tuned(tmp_path, None)
    fast, frames = _write_tuned(tmp_path, "fastdecode")
    # x264's own record of what it encoded with: fastdecode turns CABAC and the deblocking filter off.
    assert b"cabac=1" in _x264_settings(plain) and b"deblock=1" in _x264_settings(plain)
    assert b"cabac=0" in _x264_settings(fast) and b"deblock=0" in _x264_settings(fast)
    got = PyAVFrameDecoder().decode(fast, [i / FPS for i in TUNED_FRAMES]).float()
    source = torch.from_numpy(frames[TUNED_FRAMES]).permute(0, 3, 1, 2).float()
    assert (got - source).abs().mean(dim=(1, 2, 3)).max() < 2  # each frame from its own time


def test_torchcodec_reads_fastdecode_files_as_pyav_does(tmp_path):
    fast, _ = _write_tuned(tmp_path, "fastdecode")
    times = [i / FPS for i in TUNED_FRAMES]
    assert torch.equal(TorchCodecFrameDecoder().decode(fast, times), PyAVFrameDecoder().decode(fast, times))


def test_tune_is_refused_where_it_does_not_apply():
    from embodyhpc.data.video_encode import VideoOptions

    with pytest.raises(ValueError, match="tune 'fastdecode' is not supported for codec 'av1'"):
        VideoOptions(codec="av1", tune="fastdecode")
    with pytest.raises(ValueError, match="one of: film"):
        VideoOptions(tune="fast")
