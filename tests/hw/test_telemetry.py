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
        deadline = time.monotonic() + 60  # a bound, not a speed: the loop ends at the third record
        while len(sink.records) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [step for step, _ in sink.records[:3]] == [0, 1, 2]  # MLflow's: the sample number, from 0
    metrics = {name.removeprefix("system/node_0/"): value for name, value in sink.records[0][1].items()}
    assert metrics["gpu_1_utilization_percentage"] == 87.0 and metrics["gpu_0_utilization_percentage"] == 45.0
    assert metrics["gpu_1_memory_usage_megabytes"] == (40 << 30) / 1e6
    assert metrics["gpu_0_power_usage_watts"] == pytest.approx(71.234)
    assert metrics["gpu_0_temperature_celsius"] == 33.0
    assert metrics["gpu_0_sm_clock_megahertz"] == 345.0 and metrics["gpu_0_throttled"] == 0.0
    assert 0.0 <= metrics["cpu_utilization_percentage"] <= 100.0 and metrics["system_memory_usage_megabytes"] > 0
    assert 0 < metrics["system_memory_usage_percentage"] <= 100
    assert 0 < metrics["process_memory_rss_megabytes"] < metrics["system_memory_usage_megabytes"] + 1000
    assert lines == [] and not sink.closed  # the sink belongs to the caller


def test_unsupported_queries_are_left_out_not_zero():
    sampler, sink, _ = _sampler(nvml_stub.one_query_unsupported(), host=False)
    sampler.open()
    metrics = sampler.sample_once()
    sampler.stop()
    assert "system/node_0/gpu_0_power_usage_watts" not in metrics
    assert "system/node_0/gpu_0_utilization_percentage" in metrics
    assert not any(name.startswith("system/node_0/cpu") for name in metrics)


def test_throttling_gpu_warns_once_per_episode():
    gpus = nvml_stub.thermal_throttle(2)
    sampler, sink, lines = _sampler(gpus, host=False)
    sampler.open()
    metrics = sampler.sample_once()
    assert metrics["system/node_0/gpu_2_throttled"] == 1.0 and metrics["system/node_0/gpu_1_throttled"] == 0.0
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
        sampler = TelemetrySampler(sink, node="cpu-1", node_index=3, nvml=nvml, warn=lambda line: None)
        sampler.open()
        metrics = sampler.sample_once()
        sampler.stop()
        assert sorted(metrics) == ["system/node_3/cpu_utilization_percentage",
                                   "system/node_3/process_memory_rss_megabytes",
                                   "system/node_3/system_memory_usage_megabytes",
                                   "system/node_3/system_memory_usage_percentage"]


def test_stop_joins_within_the_interval_and_closes_nvml():
    stub = make_nvml(nvml_stub.healthy(2))
    sink = ListSink()
    sampler = TelemetrySampler(sink, node="n1", nvml=stub, interval_s=3600.0)
    sampler.start()
    assert sink.written.wait(60) and sampler.running
    [thread] = [t for t in threading.enumerate() if t.name == "telemetry-n1"]
    sampler.stop(timeout_s=60)  # the sampler wakes on stop: a thread still waiting out its hour would be alive
    assert not thread.is_alive() and not sampler.running
    assert len(sink.records) == 1  # the first tick runs at once, the next would come after an hour
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
        deadline = time.monotonic() + 60  # a bound, not a speed: the loop ends at the third record
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
    assert len(sink.records[0][1]) == 8 * 7 + 4  # 7 per GPU (memory percentage among them), 4 for the host
    assert sampler.ticks == 2 and sampler.tick_seconds > 0  # the cost is accounted (bench/ measures it: ~0.5 ms)


def test_a_requeued_job_continues_the_sample_numbers_and_gpu_memory_percentage():
    gpus = nvml_stub.healthy(1)
    sampler, sink, _ = _sampler(gpus, host=False, first_step=17, node_index=1)
    sampler.open()
    sampler.sample_once()
    sampler.sample_once()
    sampler.stop()
    assert [step for step, _ in sink.records] == [17, 18]
    metrics = sink.records[0][1]
    used, total = gpus[0].memory_used, gpus[0].memory_total
    assert metrics["system/node_1/gpu_0_memory_usage_percentage"] == pytest.approx(100 * used / total)
    assert all(name.startswith("system/node_1/gpu_0_") for name in metrics)
