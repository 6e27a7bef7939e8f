"""A double of torchcodec 0.13.0's CUDA video decoder, `torchcodec.decoders.VideoDecoder(source, device="cuda")`.

Read from torchcodec's source at the v0.13.0 tag (meta-pytorch/torchcodec, formerly pytorch/torchcodec):
- src/torchcodec/decoders/_video_decoder.py: `VideoDecoder(source, *, stream_index=None, dimension_order="NCHW",
  num_ffmpeg_threads=1, device=None, seek_mode="exact", transforms=None, custom_frame_mappings=None)`; seek_mode other
  than exact/approximate and dimension_order other than NCHW/NHWC are ValueErrors; device None is torch's default
  device, a torch.device becomes its string; `get_frames_at(indices)` and `get_frames_played_at(seconds)` return a
  FrameBatch(data, pts_seconds, duration_seconds);
- src/torchcodec/_core/DeviceInterface.cpp validateDeviceInterface: a build without a CUDA interface (the CPU wheel)
  refuses at construction: RuntimeError "Unsupported device: cuda (device type: cuda, variant: default)";
- src/torchcodec/_core/BetaCudaDeviceInterface.cpp (NVDEC, the default CUDA backend): its constructor first creates
  a tensor on the device (CUDACommon.cpp initializeCudaContextWithPytorch), so a CUDA build on a node without a GPU
  refuses at construction with torch's RuntimeError;
- src/torchcodec/_core/SingleStreamDecoder.cpp getFramesPlayedAt / getFramesAtIndices: a time outside
  [begin, end) of the stream is a RuntimeError; frames come back in the order asked, repeated ones decoded once;
  Frame.cpp FrameBatchOutput: `data` is allocated on the decoder's device (uint8, N x C x H x W for NCHW),
  `pts_seconds` and `duration_seconds` are float64 on the CPU.

Where it must differ (no GPU here): the frames are decoded on the CPU by the real torchcodec, and `data` is a
`CudaFrames`: a CPU tensor that says it is on cuda:N and, like a real CUDA tensor seen from host code, allows only
what moves it to the host (`.cpu()`, `.to("cpu")`) or describes it (device, dtype, shape); anything else (numpy(),
arithmetic, torch.stack with host tensors) raises. Whether a GPU is there is torch.cuda.is_available() (the
`fake_cuda` fixture makes it True); `cuda_build=False` stands for torchcodec's CPU wheel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TORCHCODEC_API = "0.13"
"""The torchcodec version whose API this double follows; a test fails when the installed torchcodec is another."""

_DESCRIBE = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.__len__, torch.Tensor.__repr__}


class CudaFrames(torch.Tensor):
    """Frames on a (pretend) GPU: only moving them to the host or describing them works (see the module doc)."""

    cuda_index = 0

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self.cuda_index)

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        getter = name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") in {
            "dtype", "shape", "ndim", "layout", "requires_grad", "_base", "grad_fn", "names", "data"}
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.cpu or (func is torch.Tensor.to and _to_host(args[1:], kwargs)):
                return args[0].as_subclass(torch.Tensor).clone()  # a copy to the host, as the real one makes
            if getter or func in _DESCRIBE:
                result = func(*args, **kwargs)
                return result.as_subclass(torch.Tensor) if isinstance(result, torch.Tensor) else result
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"cuda:{cls.cuda_index} and cpu! (the torchcodec CUDA double's frames allow only .cpu() "
                           f"and .to('cpu'); called {name})")


def _to_host(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, str | torch.device):
        return torch.device(target).type == "cpu"
    return False


class FrameBatch:
    """torchcodec's FrameBatch as far as readers use it: data, pts_seconds, duration_seconds."""

    def __init__(self, data: torch.Tensor, pts_seconds: torch.Tensor, duration_seconds: torch.Tensor) -> None:
        self.data, self.pts_seconds, self.duration_seconds = data, pts_seconds, duration_seconds


class CudaVideoDecoder:
    """torchcodec.decoders.VideoDecoder's signature and checks; device="cuda" decodes through the real CPU decoder
    and hands back CudaFrames (see the module doc). Records every file opened (class attribute `opened`)."""

    opened: list[tuple[str, str]] = []
    cuda_build = True
    """False: torchcodec's CPU wheel, which has no CUDA device interface."""

    def __init__(self, source: str | Path, *, stream_index: int | None = None, dimension_order: str = "NCHW",
                 num_ffmpeg_threads: int = 1, device: str | torch.device | None = None, seek_mode: str = "exact",
                 transforms: Any = None, custom_frame_mappings: Any = None) -> None:
        import torchcodec
        from torchcodec.decoders import VideoDecoder

        assert torchcodec.__version__.startswith(TORCHCODEC_API), (
            f"tests/doubles/torchcodec_cuda.py follows torchcodec {TORCHCODEC_API}; {torchcodec.__version__} is "
            "installed: re-read its source (see the module doc) and update the double")
        if seek_mode not in ("exact", "approximate"):
            raise ValueError(f"Invalid seek mode ({seek_mode}). Supported values are exact, approximate.")
        if dimension_order not in ("NCHW", "NHWC"):
            raise ValueError(f"Invalid dimension order ({dimension_order}). Supported values are NCHW, NHWC.")
        device = str(torch.get_default_device()) if device is None else str(device)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if not self.cuda_build:
                raise RuntimeError(f"Unsupported device: {device} (device type: cuda, variant: default)")
            if not torch.cuda.is_available():  # torch's error creating the context tensor on the device
                raise RuntimeError("Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU "
                                   "and installed a driver from http://www.nvidia.com/Download/index.aspx")
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            if index >= torch.cuda.device_count():
                raise RuntimeError("CUDA error: invalid device ordinal")
            self.device = torch.device("cuda", index)
        # the real CPU decoder does the decoding; NHWC/NCHW and seek mode behave as torchcodec's
        self._cpu = VideoDecoder(source, stream_index=stream_index, dimension_order=dimension_order,
                                 num_ffmpeg_threads=num_ffmpeg_threads, device="cpu", seek_mode=seek_mode)
        self.metadata = self._cpu.metadata
        self.opened.append((str(source), str(self.device)))

    def __len__(self) -> int:
        return len(self._cpu)

    def _on_device(self, batch: Any) -> FrameBatch:
        data = batch.data
        assert data.dtype == torch.uint8 and data.device.type == "cpu"
        if self.device.type == "cuda":
            data = data.as_subclass(CudaFrames)
            data.cuda_index = self.device.index
        return FrameBatch(data, batch.pts_seconds, batch.duration_seconds)

    def get_frames_at(self, indices: torch.Tensor | list[int]) -> FrameBatch:
        return self._on_device(self._cpu.get_frames_at(indices))

    def get_frames_played_at(self, seconds: torch.Tensor | list[float]) -> FrameBatch:
        return self._on_device(self._cpu.get_frames_played_at(seconds))
