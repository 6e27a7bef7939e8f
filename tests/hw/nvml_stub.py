"""A stand-in for nvidia-ml-py's `pynvml` module, for machines without a GPU.

It follows nvidia-ml-py 12/13's documented API: the same function names and constants, handles
from nvmlDeviceGetHandleByIndex, str names (bytes with `names_as_bytes`, as releases before 11.515
returned), memory as an object with .total/.free/.used in bytes, power in milliwatts,
nvmlDeviceGetRemappedRows as (correctable, uncorrectable, pending, failure), and NVMLError carrying
the NVML return code in `.value`. Unsupported queries raise NVMLError(NVML_ERROR_NOT_SUPPORTED).
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999
_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions", NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}
CONSTANTS = {
    "NVML_TEMPERATURE_GPU": 0, "NVML_VOLATILE_ECC": 0, "NVML_AGGREGATE_ECC": 1,
    "NVML_MEMORY_ERROR_TYPE_CORRECTED": 0, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED": 1,
    "NVML_CLOCK_GRAPHICS": 0, "NVML_CLOCK_SM": 1, "NVML_CLOCK_MEM": 2,
    "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS": 0,
    "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR": 1,
}
GIB = 1 << 30


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


@dataclass
class FakeGpu:
    """One GPU. Defaults: an idle, healthy H100 SXM (Hopper: row remapping, no page retirement)."""

    name: str = "NVIDIA H100 80GB HBM3"
    memory_total: int = 81559 * (1 << 20)
    memory_used: int = 527 * (1 << 20)  # what the driver reserves on an idle H100
    ecc: dict[tuple[int, int], int] = field(default_factory=dict)  # (error type, counter type) -> count
    retired_pages: dict[int, list[int]] | None = None  # cause -> page addresses; None: not supported
    retired_pending: int = 0
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    temperature_c: int = 33
    clocks_mask: int = 0x1  # GpuIdle
    sm_clock_mhz: int = 345
    mem_clock_mhz: int = 2619
    util_gpu: int = 0
    util_memory: int = 0
    power_mw: int = 71_234
    unsupported: set[str] = field(default_factory=set)  # nvml function names answering NOT_SUPPORTED
    failing: dict[str, int] = field(default_factory=dict)  # nvml function name -> error code
    lost: bool = False
    handle_error: int | None = None


class _Handle:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu


def make_nvml(gpus: list[FakeGpu], *, driver: str = "550.54.15", init_error: int | None = None,
              event_reasons: bool = True, names_as_bytes: bool = False) -> types.ModuleType:
    """A `pynvml`-shaped module. `event_reasons=False` mimics bindings older than 12.535 (Throttle only)."""
    mod = types.ModuleType("pynvml")
    mod.NVMLError = NVMLError
    for name, value in {**CONSTANTS, **{k: v for k, v in globals().items() if k.startswith("NVML_")}}.items():
        setattr(mod, name, value)
    mod.calls = []
    state = {"initialised": False}

    def nvmlInit() -> None:
        if init_error is not None:
            raise NVMLError(init_error)
        state["initialised"] = True

    def nvmlShutdown() -> None:
        state["initialised"] = False

    def need_init() -> None:
        if not state["initialised"]:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)

    def nvmlSystemGetDriverVersion() -> str:
        need_init()
        return driver

    def nvmlDeviceGetCount() -> int:
        need_init()
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        need_init()
        gpu = gpus[index]
        if gpu.handle_error is not None:
            raise NVMLError(gpu.handle_error)
        return _Handle(gpu)

    def device_fn(fn_name: str, body):
        def fn(handle: _Handle, *args):
            need_init()
            mod.calls.append(fn_name)
            gpu = handle.gpu
            if gpu.lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            if fn_name in gpu.unsupported:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            if fn_name in gpu.failing:
                raise NVMLError(gpu.failing[fn_name])
            return body(gpu, *args)
        fn.__name__ = fn_name
        setattr(mod, fn_name, fn)

    def retired(gpu: FakeGpu, cause: int) -> list[int]:
        if gpu.retired_pages is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return list(gpu.retired_pages.get(cause, []))

    def pending(gpu: FakeGpu) -> int:
        if gpu.retired_pages is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.retired_pending

    def rows(gpu: FakeGpu) -> tuple[int, int, int, int]:
        if gpu.remapped_rows is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return gpu.remapped_rows

    clocks = {CONSTANTS["NVML_CLOCK_SM"]: "sm_clock_mhz", CONSTANTS["NVML_CLOCK_MEM"]: "mem_clock_mhz",
              CONSTANTS["NVML_CLOCK_GRAPHICS"]: "sm_clock_mhz"}
    device_fn("nvmlDeviceGetName", lambda g: g.name.encode() if names_as_bytes else g.name)
    device_fn("nvmlDeviceGetMemoryInfo", lambda g: types.SimpleNamespace(
        total=g.memory_total, free=g.memory_total - g.memory_used, used=g.memory_used))
    device_fn("nvmlDeviceGetUtilizationRates", lambda g: types.SimpleNamespace(gpu=g.util_gpu, memory=g.util_memory))
    device_fn("nvmlDeviceGetPowerUsage", lambda g: g.power_mw)
    device_fn("nvmlDeviceGetTemperature", lambda g, sensor: g.temperature_c)
    device_fn("nvmlDeviceGetClockInfo", lambda g, kind: getattr(g, clocks[kind]))
    device_fn("nvmlDeviceGetCurrentClocksThrottleReasons", lambda g: g.clocks_mask)
    if event_reasons:
        device_fn("nvmlDeviceGetCurrentClocksEventReasons", lambda g: g.clocks_mask)
    device_fn("nvmlDeviceGetTotalEccErrors", lambda g, kind, counter: g.ecc.get((kind, counter), 0))
    device_fn("nvmlDeviceGetRetiredPages", retired)
    device_fn("nvmlDeviceGetRetiredPagesPendingStatus", pending)
    device_fn("nvmlDeviceGetRemappedRows", rows)
    for fn in (nvmlInit, nvmlShutdown, nvmlSystemGetDriverVersion, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex):
        setattr(mod, fn.__name__, fn)
    return mod


UNCORRECTED, CORRECTED = CONSTANTS["NVML_MEMORY_ERROR_TYPE_UNCORRECTED"], CONSTANTS["NVML_MEMORY_ERROR_TYPE_CORRECTED"]
VOLATILE, AGGREGATE = CONSTANTS["NVML_VOLATILE_ECC"], CONSTANTS["NVML_AGGREGATE_ECC"]


def healthy(num_gpus: int = 8) -> list[FakeGpu]:
    return [FakeGpu() for _ in range(num_gpus)]


def with_ecc_errors(gpu_index: int = 3, count: int = 12) -> list[FakeGpu]:
    gpus = healthy()
    gpus[gpu_index].ecc = {(UNCORRECTED, VOLATILE): count, (UNCORRECTED, AGGREGATE): count + 2,
                           (CORRECTED, VOLATILE): 40, (CORRECTED, AGGREGATE): 1500}
    return gpus


def with_retired_and_remapped() -> list[FakeGpu]:
    """An older V100 node (page retirement) next to the H100 cases of pending and failed row remapping."""
    v100 = [FakeGpu(name="Tesla V100-SXM2-32GB", memory_total=32 * GIB, memory_used=GIB // 2, remapped_rows=None,
                    retired_pages={0: list(range(0x1000, 0x1000 + 40)), 1: list(range(0x9000, 0x9000 + 25))},
                    retired_pending=1)
            for _ in range(2)]
    v100[1].retired_pending = 0
    pending, failed = FakeGpu(remapped_rows=(3, 1, 1, 0)), FakeGpu(remapped_rows=(0, 9, 0, 1))
    return [*v100, pending, failed]


def thermal_throttle(gpu_index: int = 2) -> list[FakeGpu]:
    gpus = healthy(4)
    # HW thermal slowdown + SW thermal slowdown + SW power cap (the cap alone would be normal under load)
    gpus[gpu_index].clocks_mask = 0x40 | 0x20 | 0x4
    gpus[gpu_index].temperature_c = 91
    gpus[gpu_index].sm_clock_mhz = 1095
    return gpus


def one_query_unsupported() -> list[FakeGpu]:
    """A GeForce-like board: no ECC, no power reading; otherwise fine."""
    gpus = healthy(2)
    for gpu in gpus:
        gpu.name = "NVIDIA GeForce RTX 4090"
        gpu.unsupported = {"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetRemappedRows"}
    return gpus
