"""`embodyhpc status` says whether training is input-bound: the share of each step spent waiting for data, rank 0's
video decode ms per sample and its loader's samples/s, from the last line of the metrics file as the training loop's
sink writes it (train/metrics.py JsonlMetricsSink). References: the numbers written, the 10% wait that makes a run
input-bound (runstate.INPUT_BOUND_WAIT_FRACTION)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from embodyhpc.train.metrics import JsonlMetricsSink

BASE = {"loss": 0.5, "lr": 1e-4, "grad_norm": 1.0, "step_time_s": 0.4, "samples_per_s_per_device": 40.0,
        "tokens_per_s": 2000.0}


def _run(root: Path, **metrics: float) -> Path:
    run = root / "demo" / "demo-20261126-100000"
    (run / "logs").mkdir(parents=True)
    (run / "resolved.yaml").write_text("job:\n  name: demo\ntrain:\n  steps: 100\n")
    (run / "run.json").write_text(json.dumps({
        "run_id": run.name, "run_dir": str(run), "backend": "local", "recipe": "demo_metaworld_cpu", "site": None,
        "overrides": [], "python": "python", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "driver": None,
        "jobs": {"train": {"kind": "train", "job_id": "101", "state": "COMPLETED"}}}))
    sink = JsonlMetricsSink(run / "logs" / "metrics.jsonl")
    sink.write(10, {**BASE, "data_wait_fraction": 0.9, "data_decode_ms_per_sample": 99.0,
                    "data_loader_samples_per_s": 1.0})  # an older log: the last one counts
    sink.write(20, {**BASE, **metrics})
    sink.close()
    return run


def _data_lines(cli, run: Path) -> list[str]:
    result = cli("status", str(run))
    assert result.code == 0, result.err
    return [line for line in result.out.splitlines() if line.startswith("data:")]


@pytest.mark.parametrize(("wait", "verdict"), [(0.25, "input-bound"), (0.1, "input-bound"),
                                               (0.05, "not input-bound")])
def test_status_says_whether_training_waits_for_its_data(cli, tmp_path, wait, verdict):
    run = _run(tmp_path, data_wait_fraction=wait, data_decode_ms_per_sample=1.734,
               data_loader_samples_per_s=1152.4)
    assert _data_lines(cli, run) == [
        f"data: waits {100 * wait:.0f}% of each step, decode 1.73 ms/sample, loader 1,152 samples/s: {verdict}"]
    progress = json.loads(cli("status", str(run), "--json").out)["progress"]
    assert (progress["data_wait_fraction"], progress["decode_ms_per_sample"], progress["loader_samples_per_s"]) == (
        wait, 1.734, 1152.4)


def test_a_run_without_loader_metrics_shows_what_it_has(cli, tmp_path):
    """A run logged before the loader counters (or a synthetic dataset): the wait alone; none at all: no line."""
    assert _data_lines(cli, _run(tmp_path / "a", data_wait_fraction=0.02)) == [
        "data: waits 2% of each step: not input-bound"]
    assert _data_lines(cli, _run(tmp_path / "b")) == []


def test_values_no_run_can_log_are_not_shown(cli, tmp_path):
    run = _run(tmp_path, data_wait_fraction=1.5, data_decode_ms_per_sample=-2.0, data_loader_samples_per_s=3e300)
    assert _data_lines(cli, run) == []
    progress = json.loads(cli("status", str(run), "--json").out)["progress"]
    assert progress["data_wait_fraction"] is None and progress["decode_ms_per_sample"] is None
