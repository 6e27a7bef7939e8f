"""The training loop on 2 gloo ranks: the tiny pi0.5 on the LeRobot fixture, with gradient accumulation 2.

One uninterrupted run (4 steps, async checkpoints every 2) serves every assertion about outputs; the resume test
then starts a fresh 2-rank job in a copy of its run directory holding only step-2, and compares steps 3-4.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from embodyhpc.checkpoint import list_steps, load_exported, read_latest, read_marker
from embodyhpc.train.metrics import METRIC_FIELDS
from tests.parallel.harness import run_ranks
from tests.train import workers

STEPS, EVERY = 4, 2


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("full_run")
    results = run_ranks(workers.train_job, 2, str(run_dir), STEPS, EVERY, timeout_s=240)
    return run_dir, results


def test_metrics_have_every_field(full_run):
    run_dir, results = full_run
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert set(METRIC_FIELDS) <= record.keys(), record
        assert record["loss"] > 0 and record["grad_norm"] > 0 and record["step_time_s"] > 0
        assert record["samples_per_s_per_device"] > 0 and record["tokens_per_s"] > 0
        assert 0 <= record["data_wait_fraction"] < 1
    # warm-up of 1 step, then cosine to 0 after step 4: step 1 at half the peak, step 2 at the peak
    assert records[0]["lr"] == pytest.approx(0.5e-3) and records[1]["lr"] == pytest.approx(1e-3)
    assert records[3]["lr"] < records[2]["lr"] < records[1]["lr"]
    assert all(r["start_step"] == 0 and r["final_step"] == STEPS for r in results)
    assert results[0]["last_metrics"] == results[1]["last_metrics"]  # reduced: the same on every rank


def test_checkpoints_and_export_are_complete(full_run):
    run_dir, results = full_run
    root = run_dir / "checkpoints"
    steps = list_steps(root)
    assert steps.newest_complete == STEPS and read_latest(root) == root / "step-4"
    assert read_marker(root / "step-2")["async"] is True
    assert read_marker(root / "step-4")["async"] is False and read_marker(root / "step-4")["world_size"] == 2
    trainer = json.loads((root / "step-4" / "trainer.json").read_text())
    assert trainer["sampler"]["num_consumed"] == STEPS * 8  # 4 steps x 2 ranks x 2 micro-batches x 2 samples
    weights, summary = load_exported(run_dir / "export")
    assert summary["step"] == STEPS and "embed_tokens.weight" in weights
    assert (run_dir / "export" / "config.yaml").read_text().startswith("model:")
    assert results[0]["export_path"] is not None and results[1]["export_path"] is None


def test_resume_continues_the_same_run(full_run, tmp_path):
    run_dir, _ = full_run
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    (resumed / "logs").mkdir()
    # the log of a job that died after step 3 was logged: the resumed run must replace that line, not repeat it
    (resumed / "logs" / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in _metrics(run_dir)[:3]))
    results = run_ranks(workers.train_job, 2, str(resumed), STEPS, EVERY, timeout_s=240)
    assert [r["start_step"] for r in results] == [2, 2]
    expected, got = _metrics(run_dir), _metrics(resumed)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for want, have in zip(expected[2:], got[2:], strict=True):
        assert have["loss"] == pytest.approx(want["loss"], abs=1e-6, rel=0)
        assert have["grad_norm"] == pytest.approx(want["grad_norm"], abs=1e-6, rel=0)
        assert have["lr"] == pytest.approx(want["lr"], abs=1e-12, rel=0)
