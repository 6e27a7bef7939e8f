"""`embodyhpc smoke`'s video decode rows (embodyhpc/data/decode_bench.py): CPU and GPU samples/s per worker, the GPU
half through the seam training uses (data/decode_device.py), run here through the double of torchcodec 0.13's CUDA
decoder (tests/doubles/torchcodec_cuda.py) with torch's CUDA doubled (`fake_cuda`). References: samples / seconds of
a clock the test advances, the frames asked for, the refusal data.decode_device=cuda gets on this node."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embodyhpc.data import decode_bench
from embodyhpc.data.decode_bench import batch_times, format_lines, measure, run_isolated, samples_per_s
from embodyhpc.data.decode_device import frame_decoder_for
from embodyhpc.train.smoke import SmokePath, SmokeReport, SmokeRow, format_report
from tests.doubles.torchcodec_cuda import CudaVideoDecoder

TINY = {"size": 32, "fps": 30, "frames": 30, "batch": 4, "timed_batches": 2}


class CountingCuda(CudaVideoDecoder):
    """The CUDA double, counting the decode calls made on the (pretend) GPU."""

    calls: list[int] = []

    def get_frames_at(self, indices):
        if self.device.type == "cuda":
            self.calls.append(len(indices))
        return super().get_frames_at(indices)

    def get_frames_played_at(self, seconds):
        if self.device.type == "cuda":
            self.calls.append(len(seconds))
        return super().get_frames_played_at(seconds)


@pytest.fixture
def double(monkeypatch):
    monkeypatch.setattr(CudaVideoDecoder, "opened", [])
    monkeypatch.setattr(CountingCuda, "calls", [])
    return CountingCuda


class VirtualClock:
    """Time that passes only when the decoder decodes: `costs` seconds for each call, in order."""

    def __init__(self, decoder, costs):
        self.decoder, self.costs, self.now, self.asked = decoder, list(costs), 0.0, []

    def __call__(self) -> float:
        return self.now

    def decode(self, path, times):
        self.asked.append(np.asarray(times))
        frames = self.decoder.decode(path, times)
        self.now += self.costs.pop(0)
        return frames


def test_samples_per_s_is_timed_samples_over_their_decode_seconds(tmp_path):
    clip = decode_bench.write_clip(tmp_path, "h264", size=32, frames=30)
    times = batch_times(30, 30, batches=3, batch=4, frames_per_sample=2)
    clock = VirtualClock(frame_decoder_for("cpu"), costs=[10.0, 0.5, 1.5])  # the warm-up batch is slow: untimed
    rate = samples_per_s(clock, clip, times, frames_per_sample=2, clock=clock)
    assert rate == pytest.approx((4 + 4) / (0.5 + 1.5))  # 2 timed batches of 4 samples (8 frames each)
    assert [len(t) for t in clock.asked] == [8, 8, 8]  # one decode call per batch, every frame of it
    for asked, wanted in zip(clock.asked, times, strict=True):
        np.testing.assert_array_equal(asked, wanted)


def test_each_sample_is_consecutive_frames_inside_the_clip():
    for times in batch_times(10, 5, batches=20, batch=8, frames_per_sample=3, seed=1):
        assert np.allclose(times * 5, np.rint(times * 5))  # on frame times
        frames = np.rint(times * 5).astype(int).reshape(8, 3)
        assert (frames >= 0).all() and (frames <= 9).all()
        assert (np.diff(frames, axis=1) == 1).all()  # a history of consecutive frames, the newest last
    with pytest.raises(ValueError, match="no sample of 3 frames"):
        batch_times(2, 30, batches=1, batch=1, frames_per_sample=3)


def test_without_a_gpu_the_cuda_half_says_why_and_opens_nothing(tmp_path, double):
    bench = measure(tmp_path, codecs=("h264",), video_decoder=double, **TINY)
    (rates,) = bench.codecs
    assert bench.status == "measured" and rates.codec == "h264" and rates.cpu_samples_per_s > 0
    assert rates.cuda_samples_per_s is None
    assert rates.cuda_reason.startswith("torch sees no GPU on this node")  # the refusal a cuda run gets here
    assert not double.opened and not double.calls


def test_on_a_gpu_node_the_cuda_half_decodes_on_the_gpu(tmp_path, double, fake_cuda):
    fake_cuda(num_devices=1)
    (rates,) = measure(tmp_path, codecs=("av1",), video_decoder=double, **TINY).codecs
    assert rates.cuda_reason is None and rates.cuda_samples_per_s > 0 and rates.cpu_samples_per_s > 0
    # the probe (one frame), then the warm-up and the timed batches, each one call of batch x 2 frames on the GPU
    assert double.calls == [1, 8, 8, 8]
    assert {device for _, device in double.opened} == {"cuda:0"}


def test_a_cpu_build_of_torchcodec_on_a_gpu_node_says_so(tmp_path, double, fake_cuda, monkeypatch):
    fake_cuda(num_devices=1)
    monkeypatch.setattr(double, "cuda_build", False)
    (rates,) = measure(tmp_path, codecs=("h264",), video_decoder=double, **TINY).codecs
    assert rates.cuda_samples_per_s is None and "Unsupported device: cuda" in rates.cuda_reason
    assert rates.cpu_samples_per_s > 0


def test_the_smoke_table_prints_the_rates_and_a_failed_decode_fails_the_smoke():
    row = SmokeRow(SmokePath("cpu bf16", device="cpu"), "passed", first_loss=2.0, last_loss=1.5)
    bench = {"status": "measured", "reason": None, "clip": "256x256 at 30 fps, 300 frames, GOP 2",
             "frames_per_sample": 2, "batch": 32,
             "codecs": [{"codec": "h264", "cpu_backend": "torchcodec", "cpu_samples_per_s": 500.0,
                         "cuda_samples_per_s": 2000.0, "cuda_reason": None},
                        {"codec": "av1", "cpu_backend": "torchcodec", "cpu_samples_per_s": 1234.5,
                         "cuda_samples_per_s": None, "cuda_reason": "torch sees no GPU on this node"}]}
    report = SmokeReport([row], device="CPU only", decode=bench)
    lines = format_report(report).splitlines()
    assert lines[-3].startswith("video decode, samples/s per worker (256x256 at 30 fps")
    assert lines[-2] == "  h264  cpu 500 (torchcodec), cuda 2,000 (4.0x the cpu)"
    assert lines[-1] == "  av1   cpu 1,234 (torchcodec), cuda -: torch sees no GPU on this node"
    assert report.ok and json.loads(json.dumps(report.as_dict()))["decode"] == bench
    report.decode = {"status": "failed", "reason": "exit 1: RuntimeError: boom"}
    assert not report.ok
    assert format_report(report).splitlines()[-1] == "video decode: failed: exit 1: RuntimeError: boom"
    assert SmokeReport([row]).ok and format_lines(None) == []  # not measured: nothing printed, nothing failed


def test_a_bench_process_that_fails_is_a_failed_bench_with_its_error():
    failed = run_isolated({"no_such_option": 1})
    assert failed["status"] == "failed" and failed["reason"].startswith("exit 1: TypeError")
    assert "no_such_option" in failed["reason"]


@pytest.mark.slow
def test_the_bench_runs_in_a_process_of_its_own():
    bench = run_isolated({**TINY, "codecs": ["h264", "av1"]})
    assert bench["status"] == "measured", bench
    assert [r["codec"] for r in bench["codecs"]] == ["h264", "av1"]
    assert all(r["cpu_samples_per_s"] > 0 and r["cuda_reason"].startswith("torch sees no GPU") for r in bench["codecs"])
