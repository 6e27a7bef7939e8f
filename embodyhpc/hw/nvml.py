"""The NVML implementation of `GpuBackend`, over nvidia-ml-py (module `pynvml`).

Every query can fail on its own: consumer GPUs have no ECC, Ampere+ retire rows instead of pages,
containers may deny power readings, new nvidia-ml-py releases drop deprecated functions. Such a
query yields None and is listed as unsupported rather than failing the whole probe; only
"GPU is lost" marks the GPU itself bad.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from embodyhpc.hw.gpu import GpuHealth, GpuSample, throttle_reason_names


class NvmlUnavailable(RuntimeError):
    """nvidia-ml-py is not installed, or NVML cannot start (no driver, no libnvidia-ml.so.1)."""


class _Unsupported(Exception):
    pass


class _Lost(Exception):
    pass


def _text(value: Any) -> str:
    # nvidia-ml-py >= 11.515 returns str; older releases returned bytes
    return value.decode() if isinstance(value, bytes) else str(value)


class _Queries:
    """Runs NVML calls for one GPU, collecting which ones were unsupported or failed."""

    def __init__(self, backend: NvmlBackend, handle: Any) -> None:
        self.backend, self.handle = backend, handle
        self.unsupported: list[str] = []
        self.errors: dict[str, str] = {}

    def __call__(self, label: str, fn_names: tuple[str, ...] | str, *args: Any) -> Any:
        """The first of `fn_names` this NVML supports, called with (handle, *args); None if none answers."""
        nvml = self.backend.nvml
        for fn_name in (fn_names,) if isinstance(fn_names, str) else fn_names:
            fn = getattr(nvml, fn_name, None)
            if fn is None:  # an older nvidia-ml-py, or a function removed from a newer one
                continue
            try:
                return fn(self.handle, *args)
            except nvml.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == self.backend.lost_code:
                    raise _Lost(str(exc)) from exc
                if code not in self.backend.unsupported_codes:
                    self.errors[label] = str(exc)
                    return None
        if label not in self.unsupported:
            self.unsupported.append(label)
        return None


class NvmlBackend:
    name = "nvml"
    note = ""

    def __init__(self, nvml: ModuleType) -> None:
        self.nvml = nvml
        # codes meaning "this GPU or driver cannot answer that", not "something is wrong"
        names = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NO_PERMISSION")
        self.unsupported_codes = {getattr(nvml, n) for n in names if hasattr(nvml, n)}
        self.lost_code = getattr(nvml, "NVML_ERROR_GPU_IS_LOST", None)

    @classmethod
    def open(cls, nvml: ModuleType | None = None) -> NvmlBackend:
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                raise NvmlUnavailable("nvidia-ml-py is not installed (pip install 'embodyhpc[gpu]')") from exc
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML did not start: {exc}") from exc
        return cls(nvml)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass

    def driver_version(self) -> str | None:
        try:
            return _text(self.nvml.nvmlSystemGetDriverVersion())
        except self.nvml.NVMLError:
            return None

    def _handles(self) -> list[tuple[int, Any]]:
        """(index, handle) per GPU; the handle is the NVMLError when NVML cannot open that GPU."""
        nvml = self.nvml
        handles: list[tuple[int, Any]] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handles.append((index, nvml.nvmlDeviceGetHandleByIndex(index)))
            except nvml.NVMLError as exc:
                handles.append((index, exc))
        return handles

    def sample(self) -> list[GpuSample]:
        samples = []
        for index, handle in self._handles():
            try:
                samples.append(GpuSample(index) if isinstance(handle, Exception) else
                               self._sample(index, _Queries(self, handle)))
            except _Lost:
                samples.append(GpuSample(index))
        return samples

    def health(self) -> list[GpuHealth]:
        return [self._health(index, handle) for index, handle in self._handles()]

    def _sample(self, index: int, q: _Queries) -> GpuSample:
        nvml = self.nvml
        memory = q("memory", "nvmlDeviceGetMemoryInfo")
        util = q("utilization", "nvmlDeviceGetUtilizationRates")
        power_mw = q("power", "nvmlDeviceGetPowerUsage")
        # "Throttle" was renamed "Event" in NVML 12.535; older drivers and bindings only have the old name
        reasons = q("throttle_reasons", ("nvmlDeviceGetCurrentClocksEventReasons",
                                         "nvmlDeviceGetCurrentClocksThrottleReasons"))
        return GpuSample(
            index=index,
            utilization_pct=None if util is None else int(util.gpu),
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            power_w=None if power_mw is None else power_mw / 1000.0,  # NVML reports milliwatts
            temperature_c=q("temperature", "nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU),
            sm_clock_mhz=q("sm_clock", "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM),
            mem_clock_mhz=q("mem_clock", "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_MEM),
            throttle_reasons=() if reasons is None else throttle_reason_names(int(reasons)),
        )

    def _health(self, index: int, handle: Any) -> GpuHealth:
        nvml = self.nvml
        if isinstance(handle, Exception):
            lost = getattr(handle, "value", None) == self.lost_code
            return GpuHealth(index=index, name="unknown", sample=GpuSample(index), lost=lost,
                             errors={} if lost else {"handle": str(handle)})
        q = _Queries(self, handle)
        try:
            name = _text(q("name", "nvmlDeviceGetName") or "unknown")
            sample = self._sample(index, q)
            ecc = {
                (kind, counter): q(f"ecc_{kind}_{counter}", "nvmlDeviceGetTotalEccErrors",
                                   getattr(nvml, f"NVML_MEMORY_ERROR_TYPE_{kind.upper()}"),
                                   getattr(nvml, f"NVML_{counter.upper()}_ECC"))
                for kind in ("uncorrected", "corrected") for counter in ("volatile", "aggregate")
            }
            # pages are retired up to Volta/Turing; Ampere and later remap rows instead (the other is unsupported)
            sbe = q("retired_pages", "nvmlDeviceGetRetiredPages",
                    nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
            dbe = None if sbe is None else q("retired_pages", "nvmlDeviceGetRetiredPages",
                                             nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
            pending = None if sbe is None else q("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
            # (correctable rows, uncorrectable rows, remapping pending, remapping failure occurred)
            rows = q("remapped_rows", "nvmlDeviceGetRemappedRows")
        except _Lost:
            return GpuHealth(index=index, name="unknown", sample=GpuSample(index), lost=True)
        return GpuHealth(
            index=index, name=name, sample=sample,
            ecc_uncorrected_volatile=ecc["uncorrected", "volatile"],
            ecc_uncorrected_aggregate=ecc["uncorrected", "aggregate"],
            ecc_corrected_volatile=ecc["corrected", "volatile"],
            ecc_corrected_aggregate=ecc["corrected", "aggregate"],
            retired_pages_sbe=None if sbe is None else len(sbe),
            retired_pages_dbe=None if dbe is None else len(dbe),
            retired_pages_pending=None if pending is None else bool(pending),
            remapped_rows_correctable=None if rows is None else int(rows[0]),
            remapped_rows_uncorrectable=None if rows is None else int(rows[1]),
            remapping_pending=None if rows is None else bool(rows[2]),
            remapping_failed=None if rows is None else bool(rows[3]),
            unsupported=tuple(q.unsupported),
            errors=q.errors,
        )
