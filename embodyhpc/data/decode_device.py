"""Where video frames are decoded (data.decode_device: cpu, cuda, auto), and the frame decoder that does it.

    device = resolve_decode_device("auto", probe=first_video_file)   # "cpu" here, "cuda" on a GPU node that decodes
    decoder = frame_decoder_for(device)

cuda is torchcodec's NVDEC decoder on the rank's current GPU (TorchCodecFrameDecoder(device="cuda")), which copies
the frames back to the host as uint8. It is refused, on one line naming data.decode_device, where torch sees no GPU,
or where torchcodec cannot open the probe file on it (torchcodec's CPU build says "Unsupported device: cuda"; its
CUDA build without a GPU fails creating its CUDA context). auto asks the same questions and answers cpu where any of
them fails. A probe opens one of the dataset's files on the GPU in the training process, which holds a CUDA context
already: the workers that decode later are started with spawn (data/loader.py), as a forked child cannot use CUDA.

`video_decoder` (everywhere below) is the class that opens a file, torchcodec.decoders.VideoDecoder by default;
tests pass a double of its CUDA decoder (tests/doubles/torchcodec_cuda.py) so every branch here runs on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embodyhpc.config.schema import DECODE_DEVICES, IMAGE_DTYPES
from embodyhpc.errors import ConfigError


def check_image_dtype(image_dtype: str) -> str:
    """A reader's image_dtype option (data.image_dtype's values), or ValueError naming them."""
    if image_dtype not in IMAGE_DTYPES:
        raise ValueError(f"image_dtype must be one of {', '.join(IMAGE_DTYPES)}, got {image_dtype!r}")
    return image_dtype


def _no_gpu_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "torch sees no GPU on this node (torch.cuda.is_available() is False)"
    return None


def _probe_reason(probe: Path | None, video_decoder: Any) -> str | None:
    """Why torchcodec cannot decode `probe` on the GPU, or None when it can (one frame decoded)."""
    if probe is None:
        return None
    try:
        decoder = video_decoder(str(probe), seek_mode="approximate", device="cuda")
        decoder.get_frames_at(indices=[0])
    except Exception as exc:  # noqa: BLE001 - torchcodec raises RuntimeError; a broken install anything
        return f"torchcodec cannot decode {probe} on the GPU ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
    return None


def resolve_decode_device(requested: str, *, probe: Path | None = None, video_decoder: Any = None) -> str:
    """"cpu" or "cuda" for data.decode_device=`requested`; ConfigError (one line) for cuda that cannot work here.

    `probe`: a video file of the dataset, opened once on the GPU to prove torchcodec's CUDA decoder works (None: the
    dataset has no video, so nothing decodes: cuda is refused, auto is cpu)."""
    if requested not in DECODE_DEVICES:
        raise ConfigError(f"{requested!r} is not one of {', '.join(DECODE_DEVICES)}", key="data.decode_device",
                          fix="set data.decode_device=cpu (or cuda, auto)")
    if requested == "cpu":
        return "cpu"
    reason = _no_gpu_reason()
    if reason is None and probe is None:
        reason = "the dataset stores no video (nothing to decode on the GPU)"
    if reason is None:
        if video_decoder is None:
            try:
                from torchcodec.decoders import VideoDecoder as video_decoder
            except (ImportError, OSError, RuntimeError) as exc:
                reason = f"torchcodec does not import ({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        if reason is None:
            reason = _probe_reason(probe, video_decoder)
    if reason is None:
        return "cuda"
    if requested == "auto":
        return "cpu"
    raise ConfigError(f"cuda cannot decode here: {reason}", key="data.decode_device",
                      fix="set data.decode_device=auto (cpu where the GPU cannot decode) or cpu")


def frame_decoder_for(device: str, *, video_decoder: Any = None, **options: Any) -> Any:
    """The FrameDecoder for a resolved device: "cpu" the reader's default choice (torchcodec, else PyAV), "cuda"
    torchcodec's NVDEC decoder."""
    from embodyhpc.data.video import TorchCodecFrameDecoder, make_frame_decoder

    if device == "cpu":
        return make_frame_decoder("auto", **options)
    return TorchCodecFrameDecoder(device=device, video_decoder=video_decoder, **options)
