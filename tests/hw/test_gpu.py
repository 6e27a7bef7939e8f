"""The NVML backend against a pynvml stub: healthy, ECC errors, retired/remapped memory, throttling,
unsupported queries, lost GPUs, and nodes without NVML."""

from __future__ import annotations

import subprocess
import sys

import pytest

from embodyhpc.hw.checks import Status
from embodyhpc.hw.gpu import (
    HARMFUL_THROTTLE_REASONS,
    THROTTLE_REASON_BITS,
    GpuBackend,
    NoGpuBackend,
    check_gpus,
    open_gpu_backend,
)
from embodyhpc.hw.nvml import NvmlBackend
from tests.helpers import require
from tests.hw import nvml_stub
from tests.hw.nvml_stub import FakeGpu, make_nvml


def _checks(gpus: list[FakeGpu], expected: int | None = None, **stub_kwargs):
    backend = open_gpu_backend(make_nvml(gpus, **stub_kwargs))
    health = backend.health()
    return backend, health, check_gpus(backend, health, expected)


def _by_name(checks):
    return {c.name: c for c in checks}


def test_healthy_node_reports_every_gpu_and_passes():
    backend, health, checks = _checks(nvml_stub.healthy(8), expected=8)
    assert isinstance(backend, NvmlBackend) and isinstance(backend, GpuBackend)
    assert len(health) == 8 and [g.index for g in health] == list(range(8))
    gpu = health[0]
    assert gpu.name == "NVIDIA H100 80GB HBM3"
    assert gpu.sample.memory_total_bytes == 81559 << 20 and gpu.sample.power_w == pytest.approx(71.234)
    assert gpu.sample.sm_clock_mhz == 345 and gpu.sample.mem_clock_mhz == 2619
    assert gpu.sample.throttle_reasons == ("gpu_idle",)
    assert gpu.ecc_uncorrected_volatile == 0 and gpu.remapping_pending is False and gpu.remapping_failed is False
    # Hopper remaps rows instead of retiring pages: that query is unsupported, not an error
    assert gpu.retired_pages_sbe is None and "retired_pages" in gpu.unsupported and gpu.errors == {}
    assert [(c.name, c.status) for c in checks] == [("gpus", Status.OK)]
    assert checks[0].reason == "8 x NVIDIA H100 80GB HBM3, driver 550.54.15"


def test_uncorrected_volatile_ecc_errors_fail_the_node():
    _, health, checks = _checks(nvml_stub.with_ecc_errors(gpu_index=3, count=12))
    assert health[3].ecc_uncorrected_volatile == 12 and health[3].ecc_corrected_aggregate == 1500
    ecc = _by_name(checks)["gpu3.ecc"]
    assert ecc.status is Status.FAIL and ecc.reason.startswith("GPU 3: 12 uncorrected ECC errors (volatile")
    assert [c.name for c in checks if c.status is not Status.OK] == ["gpu3.ecc"]


def test_uncorrected_errors_only_in_the_lifetime_counter_warn():
    gpus = nvml_stub.healthy(2)
    gpus[1].ecc = {(nvml_stub.UNCORRECTED, nvml_stub.AGGREGATE): 2}
    _, _, checks = _checks(gpus)
    assert _by_name(checks)["gpu1.ecc"].status is Status.WARN


def test_retired_pages_and_row_remapping():
    _, health, checks = _checks(nvml_stub.with_retired_and_remapped())
    v100 = health[0]
    assert (v100.retired_pages_sbe, v100.retired_pages_dbe, v100.retired_pages_pending) == (40, 25, True)
    assert v100.remapped_rows_correctable is None and "remapped_rows" in v100.unsupported
    assert (health[2].remapped_rows_uncorrectable, health[2].remapping_pending) == (1, True)
    found = sorted((c.name, c.status.value) for c in checks if c.status is not Status.OK)
    assert found == [("gpu0.pages", "fail"), ("gpu0.pages", "warn"), ("gpu1.pages", "warn"),
                     ("gpu2.remap", "fail"), ("gpu3.remap", "fail")]
    assert "row remapping failed" in _by_name(checks)["gpu3.remap"].reason


def test_thermal_throttle_warns_and_names_the_reasons():
    _, health, checks = _checks(nvml_stub.thermal_throttle(gpu_index=2))
    assert set(health[2].sample.throttle_reasons) == {"sw_power_cap", "sw_thermal_slowdown", "hw_thermal_slowdown"}
    throttle = _by_name(checks)["gpu2.throttle"]
    assert throttle.status is Status.WARN
    assert "hw_thermal_slowdown" in throttle.reason and "sw_power_cap" not in throttle.reason
    assert "1095 MHz" in throttle.reason
    assert _by_name(checks)["gpu2.temperature"].status is Status.WARN
    assert all(c.status is not Status.FAIL for c in checks)


def test_power_cap_alone_is_normal_operation():
    gpus = nvml_stub.healthy(1)
    gpus[0].clocks_mask = 0x4
    _, _, checks = _checks(gpus)
    assert [c.name for c in checks] == ["gpus"]


def test_unsupported_queries_become_none_not_errors():
    _, health, checks = _checks(nvml_stub.one_query_unsupported())
    gpu = health[0]
    assert gpu.ecc_uncorrected_volatile is None and gpu.sample.power_w is None
    assert {"ecc_uncorrected_volatile", "power", "remapped_rows", "retired_pages"} <= set(gpu.unsupported)
    assert gpu.errors == {} and gpu.sample.temperature_c == 33
    assert [(c.name, c.status) for c in checks] == [("gpus", Status.OK)]


def test_older_bindings_bytes_names_and_throttle_reasons_function():
    gpus = nvml_stub.thermal_throttle(gpu_index=0)
    backend, health, _ = _checks(gpus, event_reasons=False, names_as_bytes=True)
    assert health[0].name == "NVIDIA H100 80GB HBM3"
    assert "hw_thermal_slowdown" in health[0].sample.throttle_reasons
    assert backend.nvml.calls.count("nvmlDeviceGetCurrentClocksThrottleReasons") >= 1


def test_event_reasons_unsupported_by_the_driver_falls_back_to_throttle_reasons():
    gpus = nvml_stub.thermal_throttle(gpu_index=0)
    gpus[0].unsupported = {"nvmlDeviceGetCurrentClocksEventReasons"}
    _, health, _ = _checks(gpus)
    assert "hw_thermal_slowdown" in health[0].sample.throttle_reasons
    assert "throttle_reasons" not in health[0].unsupported


def test_lost_gpu_and_other_nvml_errors():
    gpus = nvml_stub.healthy(3)
    gpus[0].lost = True
    gpus[1].handle_error = nvml_stub.NVML_ERROR_GPU_IS_LOST
    gpus[2].failing = {"nvmlDeviceGetTemperature": nvml_stub.NVML_ERROR_UNKNOWN}
    _, health, checks = _checks(gpus)
    assert health[0].lost and health[1].lost and not health[2].lost
    assert health[2].errors == {"temperature": "Unknown Error"} and health[2].sample.temperature_c is None
    by_name = _by_name(checks)
    assert by_name["gpu0"].status is Status.FAIL and "lost" in by_name["gpu0"].reason
    assert by_name["gpu1"].status is Status.FAIL
    assert by_name["gpu2.nvml"].status is Status.WARN


def test_count_mismatch_and_leftover_memory():
    gpus = nvml_stub.healthy(7)
    gpus[5].memory_used = 40 << 30
    _, _, checks = _checks(gpus, expected=8)
    by_name = _by_name(checks)
    assert by_name["gpus"].status is Status.FAIL and "expects 8" in by_name["gpus"].reason
    assert by_name["gpu5.memory"].status is Status.WARN and "leftover" in by_name["gpu5.memory"].reason


def test_sample_is_the_cheap_telemetry_path():
    stub = make_nvml(nvml_stub.healthy(2))
    backend = open_gpu_backend(stub)
    samples = backend.sample()
    assert [s.index for s in samples] == [0, 1] and samples[1].utilization_pct == 0
    assert "nvmlDeviceGetTotalEccErrors" not in stub.calls
    backend.close()
    with pytest.raises(stub.NVMLError):
        stub.nvmlDeviceGetCount()  # shut down


def test_nvml_that_cannot_start_gives_the_none_backend():
    backend = open_gpu_backend(make_nvml([], init_error=nvml_stub.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert isinstance(backend, NoGpuBackend) and isinstance(backend, GpuBackend)
    assert "NVML Shared Library Not Found" in backend.note
    assert backend.health() == [] and backend.sample() == [] and backend.driver_version() is None
    plain = check_gpus(backend, [])
    assert plain[0].status is Status.WARN and "no GPU visible" in plain[0].reason
    assert check_gpus(backend, [], expected_count=4)[0].status is Status.FAIL


def test_missing_nvidia_ml_py_gives_the_none_backend(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    backend = open_gpu_backend()
    assert isinstance(backend, NoGpuBackend) and "nvidia-ml-py is not installed" in backend.note


def test_importing_the_package_loads_neither_torch_nor_pynvml():
    code = "import sys, embodyhpc.hw; print(sorted({'torch', 'pynvml'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_stub_and_constants_match_the_real_nvidia_ml_py():
    """Guards the stub and our bit table against the installed nvidia-ml-py (skipped when absent)."""
    pynvml = require("pynvml", "gpu")
    for name, value in nvml_stub.CONSTANTS.items():
        assert getattr(pynvml, name) == value, name
    for name in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_LIBRARY_NOT_FOUND",
                 "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_NO_PERMISSION"):
        assert getattr(pynvml, name) == getattr(nvml_stub, name), name
    stub = make_nvml([])
    stub_functions = {n for n in dir(stub) if n.startswith("nvml")}
    missing = sorted(n for n in stub_functions if not hasattr(pynvml, n))
    assert missing == []
    real_names = {"gpu_idle": "GpuIdle", "sw_power_cap": "SwPowerCap", "hw_slowdown": "HwSlowdown",
                  "sw_thermal_slowdown": "SwThermalSlowdown", "hw_thermal_slowdown": "HwThermalSlowdown",
                  "hw_power_brake_slowdown": "HwPowerBrakeSlowdown", "sync_boost": "SyncBoost",
                  "applications_clocks_setting": "ApplicationsClocksSetting",
                  "display_clock_setting": "DisplayClockSetting"}
    for bit, name in THROTTLE_REASON_BITS.items():
        assert getattr(pynvml, f"nvmlClocksThrottleReason{real_names[name]}") == bit, name
    assert HARMFUL_THROTTLE_REASONS <= set(THROTTLE_REASON_BITS.values())
    assert isinstance(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED).value, int)
