"""A CUDA double for CPU tests: torch believes it has `num_devices` GPUs, and every CUDA call embodyhpc's device
branches make (and the torch code they go through) is answered by this object, which records what happened.

It follows the API of torch 2.13.0 as installed, read from its source:
- torch/cuda/__init__.py: is_available(), device_count(), current_device(), is_initialized(), set_device(device)
  (the device index comes from torch.cuda._utils._get_device_index, used here as is: a bare "cuda" raises);
- torch/cuda/__init__.py also: current_stream(device=None) and stream(stream), what DCP's FileSystemWriter uses
  when CUDA is available (torch/distributed/checkpoint/filesystem.py, _OverlappingCpuLoader);
- torch/cuda/random.py: get_rng_state(device="cuda") / set_rng_state(state, device="cuda") act on the current
  device when the device has no index, the *_all variants loop over device_count(); manual_seed_all seeds each;
- torch/accelerator/__init__.py: is_available(), current_accelerator(check_available=False), current_device_index(),
  set_device_index(device), synchronize(device=None), current_stream(device=None): what the DataLoader
  (pin-memory thread), DCP's DefaultStager and the optimizers' graph-capture check (torch/optim/optimizer.py:
  `current_stream().is_capturing()`) call;
- Tensor.pin_memory() / Tensor.is_pinned(): torch/utils/data/_utils/pin_memory.py calls `data.pin_memory()` with no
  argument; the double returns a copy (a new tensor, as the real one does) and remembers it as pinned;
- torch/cuda/_pin_memory_utils.py: pin_memory(data_ptr, size) / unpin_memory(data_ptr) (cudaHostRegister), what
  DCP's StateDictStager calls to pin its staging buffers; the double keeps the registered ranges.

Where it must differ (no GPU): nothing moves to a device, generator states are 16 random bytes per device, and
pinned memory is ordinary memory. Tests use the `fake_cuda` fixture (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.cuda._utils import _get_device_index

TORCH_API = "2.13"
"""The torch version whose API this double follows; a test fails when the installed torch is another minor."""


class FakeCuda:
    def __init__(self, monkeypatch: Any, num_devices: int = 2, *, initialized: bool = True) -> None:
        assert torch.__version__.startswith(TORCH_API), (
            f"tests/cuda_doubles.py follows torch {TORCH_API}; torch {torch.__version__} is installed: re-read its "
            "source (see the module doc) and update the double")
        self.num_devices = num_devices
        self.current = 0
        self.initialized = initialized
        self.events: list[tuple[Any, ...]] = []
        """What was called, in order: ("set_device", index), ("synchronize",), ("pin", id) ..."""
        generator = torch.Generator().manual_seed(1234)
        self.rng_states = {i: torch.randint(0, 256, (16,), dtype=torch.uint8, generator=generator)
                           for i in range(num_devices)}
        self.pinned: list[torch.Tensor] = []
        """Tensors Tensor.pin_memory() returned (kept alive, so their identity stays theirs)."""
        self.host_registered: dict[int, int] = {}
        """data_ptr -> bytes, for memory pinned in place (cudaHostRegister) and not yet unpinned."""
        self.num_host_registrations = 0
        self.stream = _Stream(self.events)
        """The one stream of every device (torch's current stream, as nothing here makes others)."""

        cuda = torch.cuda
        for name, fn in (("is_available", lambda: True), ("device_count", lambda: self.num_devices),
                         ("current_device", lambda: self.current), ("is_initialized", lambda: self.initialized),
                         ("set_device", self.set_device), ("get_rng_state", self.get_rng_state),
                         ("set_rng_state", self.set_rng_state), ("get_rng_state_all", self.get_rng_state_all),
                         ("set_rng_state_all", self.set_rng_state_all), ("manual_seed_all", self.manual_seed_all),
                         ("manual_seed", lambda seed: self._seed(self.current, seed)),
                         ("current_stream", lambda device=None: self.stream),
                         ("stream", lambda stream: contextlib.nullcontext(stream))):
            monkeypatch.setattr(cuda, name, fn)
        accelerator = torch.accelerator
        for name, fn in (("is_available", lambda: True),
                         ("current_accelerator", lambda check_available=False: torch.device("cuda")),
                         ("current_device_index", lambda: self.current),
                         ("set_device_index", self.set_device_index),
                         ("synchronize", lambda device=None: self.events.append(("synchronize",))),
                         ("current_stream", lambda device=None: self.stream)):
            monkeypatch.setattr(accelerator, name, fn)
        # functions (not bound methods), so that they bind to the tensor as Tensor's own methods do
        monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor, device=None: self._pin(tensor))
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor, device=None: self.is_pinned(tensor))
        import torch.cuda._pin_memory_utils as pin_memory_utils

        monkeypatch.setattr(pin_memory_utils, "pin_memory", self._host_register)
        monkeypatch.setattr(pin_memory_utils, "unpin_memory", self._host_unregister)

    # ---- devices ----
    def set_device(self, device: Any) -> None:
        index = _get_device_index(device)  # torch's own parsing: "cuda:1", 1, torch.device("cuda", 1)
        if index < 0:
            return
        if index >= self.num_devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {index} of {self.num_devices})")
        self.current = index
        self.initialized = True  # torch._C._cuda_setDevice initialises CUDA
        self.events.append(("set_device", index))

    def set_device_index(self, device: Any) -> None:
        self.events.append(("accelerator.set_device_index", _get_device_index(device)))

    # ---- RNG: one generator state per device ----
    def _index(self, device: Any) -> int:
        if isinstance(device, str):
            device = torch.device(device)
        elif isinstance(device, int):
            device = torch.device("cuda", device)
        return self.current if device.index is None else device.index

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        self.initialized = True  # "This function eagerly initializes CUDA."
        return self.rng_states[self._index(device)].clone()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        if new_state.dtype != torch.uint8 or new_state.device.type != "cpu":
            raise TypeError(f"expected a CPU ByteTensor, got {new_state.dtype} on {new_state.device}")
        self.rng_states[self._index(device)] = new_state.clone()
        self.events.append(("set_rng_state", self._index(device)))

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.num_devices)]

    def set_rng_state_all(self, new_states: Any) -> None:
        for i, state in enumerate(new_states):
            self.set_rng_state(state, i)

    def manual_seed_all(self, seed: int) -> None:
        for i in range(self.num_devices):
            self._seed(i, seed)

    def _seed(self, index: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(int(seed) % 2**63 + index)
        self.rng_states[index] = torch.randint(0, 256, (16,), dtype=torch.uint8, generator=generator)

    def draw(self, device: int | None = None) -> None:
        """Advance a device's generator, as a kernel drawing random numbers there would."""
        index = self.current if device is None else device
        self.rng_states[index] = (self.rng_states[index].to(torch.int32) * 5 + 1).remainder(256).to(torch.uint8)

    # ---- pinned memory ----
    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.clone()
        self.pinned.append(pinned)
        self.events.append(("pin", id(pinned)))
        return pinned

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return any(tensor is p for p in self.pinned)

    def _host_register(self, data_ptr: int, size: int) -> None:
        if data_ptr in self.host_registered:
            raise RuntimeError("Registering memory failed with cudaError: 712 (already registered)")
        self.host_registered[data_ptr] = size
        self.num_host_registrations += 1
        self.events.append(("host_register", data_ptr, size))

    def _host_unregister(self, data_ptr: int) -> None:
        if self.host_registered.pop(data_ptr, None) is None:
            raise AssertionError("Unpinning shared memory failed with error-code: 713 (not registered)")
        self.events.append(("host_unregister", data_ptr))

    def is_host_registered(self, tensor: torch.Tensor) -> bool:
        """Whether the tensor's bytes lie in memory pinned in place."""
        start = tensor.untyped_storage().data_ptr()
        return any(ptr <= start < ptr + size for ptr, size in self.host_registered.items())


class _Stream:
    """What torch.cuda / torch.accelerator.current_stream() return, as far as torch's callers here use it."""

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self._events = events

    def is_capturing(self) -> bool:
        return False  # no CUDA graph is being captured

    def synchronize(self) -> None:
        self._events.append(("stream.synchronize",))

    def wait_stream(self, other: _Stream) -> None:
        self._events.append(("stream.wait_stream",))
