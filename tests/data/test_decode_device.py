"""data.decode_device: cpu, cuda (torchcodec's NVDEC decoder) or auto. The cuda path runs here through a double of
torchcodec 0.13.0's CUDA VideoDecoder (tests/doubles/torchcodec_cuda.py: refuses without a GPU, returns uint8 NCHW
frames on the decoder's device that allow only a copy to the host) with torch's CUDA doubled (tests/cuda_doubles.py).
References: the frames the CPU decoder gives for the same items; the refusal's one line.
"""

from __future__ import annotations

import pytest
import torch

from embodyhpc.config.schema import DataConfig
from embodyhpc.data import open_dataset
from embodyhpc.data.decode_device import resolve_decode_device
from embodyhpc.data.loader import configure_frames, worker_start_method
from embodyhpc.data.video import TorchCodecFrameDecoder
from embodyhpc.errors import ConfigError
from tests.doubles.torchcodec_cuda import CudaFrames, CudaVideoDecoder

DELTA = {"observation.images.wrist": [-0.1, 0.0], "action": [0.0, 0.1]}


@pytest.fixture
def double(monkeypatch):
    monkeypatch.setattr(CudaVideoDecoder, "opened", [])
    return CudaVideoDecoder


def _data(root, **options) -> DataConfig:
    return DataConfig(format="lerobot", root=str(root), **options)


def test_cuda_without_a_gpu_is_refused_on_one_line(sample_root, double):
    dataset = open_dataset(sample_root, DELTA)
    with pytest.raises(ConfigError) as refused:
        configure_frames(dataset, _data(sample_root, decode_device="cuda"), video_decoder=double)
    line = refused.value.one_line()
    assert "\n" not in line and "data.decode_device" in line and "torch sees no GPU" in line
    assert "data.decode_device=auto" in line  # the fix
    assert not double.opened  # refused before any file is opened on a device


def test_auto_without_a_gpu_decodes_on_the_cpu(sample_root, double):
    dataset = open_dataset(sample_root, DELTA)
    assert configure_frames(dataset, _data(sample_root, decode_device="auto"), video_decoder=double) == "cpu"
    assert getattr(dataset.decoder, "device", "cpu") == "cpu" and not double.opened
    assert worker_start_method("cpu", 2) is None  # fork, as before


def test_the_cuda_path_gives_the_cpu_frames_through_the_double(sample_root, double, fake_cuda):
    fake_cuda(num_devices=1)
    cpu_set = open_dataset(sample_root, DELTA, image_dtype="uint8", video_backend="torchcodec")
    gpu_set = open_dataset(sample_root, DELTA)
    device = configure_frames(gpu_set, _data(sample_root, decode_device="cuda", image_dtype="uint8"),
                              video_decoder=double)
    assert device == "cuda" and worker_start_method(device, 2) == "spawn" and worker_start_method(device, 0) is None
    assert isinstance(gpu_set.decoder, TorchCodecFrameDecoder) and gpu_set.decoder.device == "cuda"
    assert double.opened[0][1] == "cuda:0"  # the probe opened a file on the GPU
    indices = [0, 45, 119, 3]
    for got, want in zip(gpu_set.__getitems__(indices), [cpu_set[i] for i in indices], strict=True):
        for key in ("observation.images.wrist", "observation.images.top"):
            assert type(got[key]) is torch.Tensor and got[key].dtype == torch.uint8  # back on the host
            assert torch.equal(got[key], want[key]), key
    assert {device for _, device in double.opened} == {"cuda:0"}


def test_the_double_is_as_strict_as_torchcodec(sample_root, double, fake_cuda):
    path = open_dataset(sample_root).video_path("observation.images.wrist", 0)
    with pytest.raises(RuntimeError, match="NVIDIA driver"):
        double(path, device="cuda")  # no GPU: torch's error creating the decoder's context
    fake_cuda(num_devices=1)
    frames = double(path, device="cuda", seek_mode="approximate").get_frames_played_at(seconds=[0.1, 0.0]).data
    assert isinstance(frames, CudaFrames) and frames.device == torch.device("cuda", 0)
    assert frames.dtype == torch.uint8 and frames.shape == (2, 3, 48, 48)  # NCHW
    with pytest.raises(RuntimeError, match="same device"):
        torch.stack([frames, frames])  # host code cannot use GPU frames until they are copied
    assert type(frames.cpu()) is torch.Tensor
    double.cuda_build = False  # torchcodec's CPU wheel on a GPU node
    with pytest.raises(RuntimeError, match="Unsupported device: cuda"):
        double(path, device="cuda")


def test_a_cpu_build_of_torchcodec_refuses_cuda_and_auto_falls_back(sample_root, double, fake_cuda, monkeypatch):
    fake_cuda(num_devices=1)
    monkeypatch.setattr(double, "cuda_build", False)
    probe = open_dataset(sample_root).first_video_file()
    with pytest.raises(ConfigError, match="Unsupported device: cuda"):
        resolve_decode_device("cuda", probe=probe, video_decoder=double)
    assert resolve_decode_device("auto", probe=probe, video_decoder=double) == "cpu"


def test_a_dataset_without_video_refuses_cuda(fake_cuda, tmp_path):
    fake_cuda(num_devices=1)
    with pytest.raises(ConfigError, match="no video"):
        resolve_decode_device("cuda", probe=None)
    assert resolve_decode_device("auto", probe=None) == "cpu"
    with pytest.raises(ConfigError, match="'gpu' is not one of cpu, cuda, auto"):
        DataConfig(decode_device="gpu")
