"""TelemetrySampler with the NVML stub and a list-collecting sink."""

from __future__ import annotations

import threading
import time

import pytest

from embodyhpc.hw import NoGpuBackend
from embodyhpc.tracking.telemetry import TelemetrySampler
from tests.hw import nvml_stub
from tests.hw.nvml_stub import NVML_ERROR_DRIVER_NOT_LOADED, make_nvml


class ListSink:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict[str, float]]] = []
        self.closed = False
        self.written = threading.Event()

    def write(self, step, metrics):
        self.records.append((step, dict(metrics)))
        self.written.set()

    def close(self):
        self.closed = True


def _sampler(gpus, **kwargs):
    sink, lines = ListSink(), []
    sampler = TelemetrySampler(sink, node="n1", nvml=make_nvml(gpus), warn=lines.append, **kwargs)
    return sampler, sink, lines


def test_gpu_and_host_metrics_reach_the_sink_every_interval():
    gpus = nvml_stub.healthy(2)
    gpus[0].util_gpu, gpus[1].util_gpu, gpus[1].memory_used = 45, 87, 40 << 30
    sampler, sink, lines = _sampler(gpus, interval_s=0.05)
    with sampler:
        deadline = time.monotonic() + 5
        while len(sink.records) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [step for step, _ in sink.records[:3]] == [1, 2, 3]
    metrics = sink.records[0][1]
    assert metrics["sys/n1/gpu1/util"] == 87.0 and metrics["sys/n1/gpu0/util"] == 45.0
    assert metrics["sys/n1/gpu1/mem_used_gib"] == 40.0
    assert metrics["sys/n1/gpu0/power_w"] == pytest.approx(71.234) and metrics["sys/n1/gpu0/temp_c"] == 33.0
    assert metrics["sys/n1/gpu0/sm_clock_mhz"] == 345.0 and metrics["sys/n1/gpu0/throttled"] == 0.0
    assert 0.0 <= metrics["sys/n1/cpu_pct"] <= 100.0 and metrics["sys/n1/mem_used_gib"] > 0
    assert 0 < metrics["sys/n1/mem_pct"] <= 100 and 0 < metrics["sys/n1/rss_gib"] < metrics["sys/n1/mem_used_gib"] + 1
    assert lines == [] and not sink.closed  # the sink belongs to the caller


def test_unsupported_queries_are_left_out_not_zero():
    sampler, sink, _ = _sampler(nvml_stub.one_query_unsupported(), host=False)
    sampler.open()
    metrics = sampler.sample_once()
    sampler.stop()
    assert "sys/n1/gpu0/power_w" not in metrics and "sys/n1/gpu0/util" in metrics
    assert not any(name.startswith("sys/n1/cpu") for name in metrics)


def test_throttling_gpu_warns_once_per_episode():
    gpus = nvml_stub.thermal_throttle(2)
    sampler, sink, lines = _sampler(gpus, host=False)
    sampler.open()
    metrics = sampler.sample_once()
    assert metrics["sys/n1/gpu2/throttled"] == 1.0 and metrics["sys/n1/gpu1/throttled"] == 0.0
    assert lines == ["node n1: GPU 2 is throttling (sw_thermal_slowdown, hw_thermal_slowdown), 91 C, "
                     "SM clock 1095 MHz, 71 W"]
    sampler.sample_once()
    assert len(lines) == 1  # still throttling: not repeated every tick
    gpus[2].clocks_mask = 0x4  # a power cap alone is normal under load
    sampler.sample_once()
    gpus[2].clocks_mask = 0x8  # hw_slowdown: a new episode warns again
    sampler.sample_once()
    sampler.stop()
    assert len(lines) == 2 and "GPU 2 is throttling (hw_slowdown)" in lines[1]


def test_idle_gpu_among_busy_ones_warns():
    gpus = nvml_stub.healthy(4)
    for gpu, util in zip(gpus, (93, 97, 2, 88), strict=True):
        gpu.util_gpu = util
    sampler, _, lines = _sampler(gpus, host=False, rewarn_s=0.0)
    sampler.open()
    sampler.sample_once()
    assert lines == ["node n1: GPU 2 is idle (2 % utilisation) while others are busy (GPU 0, 1, 3 above 50 %): "
                     "a stalled rank or a data-loading straggler?"]
    sampler.sample_once()
    assert len(lines) == 2  # rewarn_s=0: a persisting condition repeats
    for gpu in gpus:
        gpu.util_gpu = 0  # all idle (between jobs, at a barrier): nothing to say
    sampler.sample_once()
    sampler.stop()
    assert len(lines) == 2


def test_no_gpu_gives_host_metrics_only():
    for nvml in (NoGpuBackend(), make_nvml([], init_error=NVML_ERROR_DRIVER_NOT_LOADED)):
        sink = ListSink()
        sampler = TelemetrySampler(sink, node="cpu-1", nvml=nvml, warn=lambda line: None)
        sampler.open()
        metrics = sampler.sample_once()
        sampler.stop()
        assert sorted(metrics) == ["sys/cpu-1/cpu_pct", "sys/cpu-1/mem_pct", "sys/cpu-1/mem_used_gib",
                                   "sys/cpu-1/rss_gib"]


def test_stop_joins_within_the_interval_and_closes_nvml():
    stub = make_nvml(nvml_stub.healthy(2))
    sink = ListSink()
    sampler = TelemetrySampler(sink, node="n1", nvml=stub, interval_s=5.0)
    sampler.start()
    assert sink.written.wait(5) and sampler.running
    start = time.perf_counter()
    sampler.stop()
    assert time.perf_counter() - start < 1.0 and not sampler.running
    assert len(sink.records) == 1  # the first tick runs at once, the next would come after 5 s
    with pytest.raises(stub.NVMLError):
        stub.nvmlDeviceGetCount()  # nvmlShutdown ran
    with pytest.raises(ValueError, match="interval_s"):
        TelemetrySampler(sink, node="n1", interval_s=0)


def test_a_failing_sink_warns_once_and_sampling_goes_on():
    class Broken(ListSink):
        def write(self, step, metrics):
            super().write(step, metrics)
            raise OSError("disk full")

    sink, lines = Broken(), []
    sampler = TelemetrySampler(sink, node="n1", nvml=NoGpuBackend(), warn=lines.append, interval_s=0.02)
    with sampler:
        deadline = time.monotonic() + 5
        while len(sink.records) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(sink.records) >= 3
    assert lines == ["telemetry n1: the metrics sink failed (OSError('disk full')); still sampling"]


def test_step_fn_and_tick_cost():
    steps = iter([10, 20])
    sampler, sink, _ = _sampler(nvml_stub.healthy(8), step_fn=lambda: next(steps))
    sampler.open()
    sampler.sample_once()
    sampler.sample_once()
    sampler.stop()
    assert [step for step, _ in sink.records] == [10, 20]
    assert len(sink.records[0][1]) == 8 * 6 + 4
    assert 0 < sampler.tick_seconds / sampler.ticks < 0.05  # generous: measured ~0.5 ms with 8 stub GPUs
