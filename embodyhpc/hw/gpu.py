"""GPU telemetry and health behind one interface, and the rules that judge a GPU fit for a job.

`GpuBackend` is the only way this package (and the telemetry sampler) talks to GPUs. The NVML
backend (`embodyhpc.hw.nvml`) needs nvidia-ml-py and a driver; `NoGpuBackend` stands in when
either is missing, so a CPU node reports "no GPU" plainly instead of crashing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol, runtime_checkable

from embodyhpc.hw.checks import Check, fail, human_bytes, ok, warn

# NVML clocks event (throttle) reason bits, a stable part of the NVML ABI; a test checks them against
# nvidia-ml-py's constants when it is installed. Bits not named here are reported as "bit0x...".
THROTTLE_REASON_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that mean the GPU cannot run at full speed for physical reasons. Idle, a power cap under
# load and sync boost are normal operation and never warn.
HARMFUL_THROTTLE_REASONS = frozenset(
    {"hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"})

# NVIDIA's guidance for pre-Ampere GPUs: a board with this many retired pages is due for replacement.
RETIRED_PAGES_LIMIT = 60
# Memory already in use before the job starts: a leftover process from a previous job, usually.
BUSY_MEMORY_FRACTION = 0.05


def throttle_reason_names(mask: int) -> tuple[str, ...]:
    names = [name for bit, name in THROTTLE_REASON_BITS.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASON_BITS)
    if unknown:
        names.append(f"bit{unknown:#x}")
    return tuple(names)


@dataclass(frozen=True)
class GpuSample:
    """What changes second to second: cheap to read, what the telemetry sampler logs. None = not supported."""

    index: int
    utilization_pct: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_w: float | None = None
    temperature_c: int | None = None
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    throttle_reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuHealth:
    """One GPU as the preflight sees it. Counters are None where the GPU or driver does not support the query
    (ECC off, retired pages on Ampere+, remapped rows before Ampere); `unsupported` names those queries."""

    index: int
    name: str
    sample: GpuSample
    ecc_uncorrected_volatile: int | None = None
    ecc_uncorrected_aggregate: int | None = None
    ecc_corrected_volatile: int | None = None
    ecc_corrected_aggregate: int | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapping_pending: bool | None = None
    remapping_failed: bool | None = None
    lost: bool = False
    unsupported: tuple[str, ...] = ()
    errors: dict[str, str] = field(default_factory=dict)
    """Queries that failed for another reason than "not supported", with NVML's message."""


@runtime_checkable
class GpuBackend(Protocol):
    """GPU telemetry and health. `name` is "nvml" or "none"; `note` says why there are no GPUs, if so."""

    name: str
    note: str

    def driver_version(self) -> str | None: ...

    def health(self) -> list[GpuHealth]:
        """Every GPU, with ECC/retirement counters: for the preflight (tens of ms per GPU)."""
        ...

    def sample(self) -> list[GpuSample]:
        """Every GPU, cheap fields only: for periodic telemetry."""
        ...

    def close(self) -> None: ...


class NoGpuBackend:
    """No NVML or no GPU: an empty, honest answer, with the reason kept for the report."""

    name = "none"

    def __init__(self, note: str = "no NVIDIA GPU") -> None:
        self.note = note

    def driver_version(self) -> str | None:
        return None

    def health(self) -> list[GpuHealth]:
        return []

    def sample(self) -> list[GpuSample]:
        return []

    def close(self) -> None:
        pass


def open_gpu_backend(nvml_module: ModuleType | None = None) -> GpuBackend:
    """NVML when nvidia-ml-py imports and nvmlInit succeeds, else NoGpuBackend with the reason.

    `nvml_module` replaces `import pynvml` (tests pass a stub); the import stays lazy so that the
    package, the CLI and CPU-only installs never need nvidia-ml-py.
    """
    from embodyhpc.hw.nvml import NvmlBackend, NvmlUnavailable

    try:
        return NvmlBackend.open(nvml_module)
    except NvmlUnavailable as exc:
        return NoGpuBackend(str(exc))


def check_gpus(backend: GpuBackend, gpus: list[GpuHealth], expected_count: int | None = None,
               temperature_warn_c: int = 85) -> list[Check]:
    """A summary line, then one line per problem found on a GPU."""
    checks: list[Check] = []
    if not gpus:
        if expected_count:
            checks.append(fail("gpus", f"no GPU visible ({backend.note}), the job expects {expected_count}"))
        else:
            checks.append(warn("gpus", f"no GPU visible ({backend.note})"))
        return checks
    models = sorted({g.name for g in gpus})
    summary = f"{len(gpus)} x {', '.join(models)}, driver {backend.driver_version() or 'unknown'}"
    if expected_count is not None and len(gpus) != expected_count:
        checks.append(fail("gpus", f"{summary}: the job expects {expected_count} GPUs"))
    else:
        checks.append(ok("gpus", summary))
    for gpu in gpus:
        checks.extend(_gpu_problems(gpu, temperature_warn_c))
    return checks


def _gpu_problems(gpu: GpuHealth, temperature_warn_c: int) -> list[Check]:
    i, found = gpu.index, []
    if gpu.lost:
        return [fail(f"gpu{i}", f"GPU {i} is lost (fell off the bus); reboot the node")]
    if gpu.ecc_uncorrected_volatile:
        found.append(fail(f"gpu{i}.ecc", f"GPU {i}: {gpu.ecc_uncorrected_volatile} uncorrected ECC errors "
                                         "(volatile, since the last reset)"))
    elif gpu.ecc_uncorrected_aggregate:
        found.append(warn(f"gpu{i}.ecc", f"GPU {i}: {gpu.ecc_uncorrected_aggregate} uncorrected ECC errors "
                                         "in its lifetime (aggregate), none since the last reset"))
    if gpu.remapping_failed:
        found.append(fail(f"gpu{i}.remap", f"GPU {i}: row remapping failed; the GPU needs service"))
    elif gpu.remapping_pending:
        # until the reset, the faulty row stays in use and a second error there kills the job
        found.append(fail(f"gpu{i}.remap", f"GPU {i}: row remapping pending; reset the GPU before use"))
    if gpu.retired_pages_pending:
        found.append(fail(f"gpu{i}.pages", f"GPU {i}: page retirement pending; reset the GPU before use"))
    retired = (gpu.retired_pages_sbe or 0) + (gpu.retired_pages_dbe or 0)
    if retired >= RETIRED_PAGES_LIMIT:
        found.append(warn(f"gpu{i}.pages", f"GPU {i}: {retired} retired pages (limit {RETIRED_PAGES_LIMIT}); "
                                           "schedule a replacement"))
    harmful = [r for r in gpu.sample.throttle_reasons if r in HARMFUL_THROTTLE_REASONS]
    if harmful:
        clock = f", SM clock {gpu.sample.sm_clock_mhz} MHz" if gpu.sample.sm_clock_mhz is not None else ""
        found.append(warn(f"gpu{i}.throttle", f"GPU {i} is throttled ({', '.join(harmful)}){clock}"))
    temp = gpu.sample.temperature_c
    if temp is not None and temp >= temperature_warn_c:
        found.append(warn(f"gpu{i}.temperature", f"GPU {i} is at {temp} C (warn at {temperature_warn_c} C)"))
    used, total = gpu.sample.memory_used_bytes, gpu.sample.memory_total_bytes
    if used is not None and total and used > BUSY_MEMORY_FRACTION * total:
        found.append(warn(f"gpu{i}.memory", f"GPU {i} has {human_bytes(used)} of {human_bytes(total)} in use "
                                            "before the job starts (a leftover process?)"))
    for query, message in gpu.errors.items():
        found.append(warn(f"gpu{i}.nvml", f"GPU {i}: NVML {query} failed: {message}"))
    return found
