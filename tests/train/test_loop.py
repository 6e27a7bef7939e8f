"""The training loop on 2 gloo ranks: the tiny pi0.5 on the LeRobot fixture, with gradient accumulation 2.

One uninterrupted run (4 steps, async checkpoints every 2) serves every assertion about outputs; the resume test
then starts a fresh 2-rank job in a copy of its run directory holding only step-2, and compares steps 3-4.
The preemption test stops a run with SIGUSR2 sent to one rank and resumes it; the reshard tests resume step-2 of
the uninterrupted run on 1 and on 3 ranks.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from embodyhpc.checkpoint import list_steps, load_exported, read_latest, read_marker
from embodyhpc.config.resolve import resolve
from embodyhpc.data.sampler import epoch_permutation
from embodyhpc.train.loop import train
from embodyhpc.train.metrics import METRIC_FIELDS, logs_at
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


def test_extra_sinks_get_rank_0s_logged_steps_and_are_closed_after_them(full_run):
    """The launcher's extra sinks (MLflow) receive what metrics.jsonl holds, on rank 0 only, then are closed."""
    run_dir, results = full_run
    logged = [{"step": step, **metrics} for step, metrics in results[0]["extra_sink"][:-1]]
    assert logged == _metrics(run_dir) and results[0]["extra_sink"][-1] == "close"
    assert results[1]["extra_sink"] == []  # rank 1 writes no metrics, not even to a sink it was handed


@pytest.mark.parametrize(("log_every", "last_step", "logged"), [
    (4, 10, [4, 8, 10]), (5, 10, [5, 10]), (1, 3, [1, 2, 3]), (20, 10, [10])])
def test_steps_log_every_log_every_steps_and_at_the_last(log_every, last_step, logged):
    assert [step for step in range(1, last_step + 1) if logs_at(step, log_every, last_step)] == logged


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


@pytest.mark.slow  # 2 training jobs of 2 ranks: 1.9-2.6 s alone here, over the fast loop's budget under load
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


def _same_steps(expected: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got, strict=True):
        assert have["loss"] == pytest.approx(want["loss"], abs=1e-6, rel=0)
        assert have["grad_norm"] == pytest.approx(want["grad_norm"], abs=1e-6, rel=0)
        assert have["lr"] == pytest.approx(want["lr"], abs=1e-12, rel=0)


# ---- preemption: a signal on one rank, every rank stops at the same step, resume continues exactly ----
@pytest.mark.slow
def test_sigusr2_on_one_rank_stops_every_rank_at_one_step_and_the_resume_continues_exactly(full_run, tmp_path):
    run_dir, _ = full_run
    stopped_dir = tmp_path / "preempted"
    # rank 1 alone receives SIGUSR2 just before its 3rd micro-batch, i.e. in the middle of step 2 (2 per step);
    # periodic saves are off (every 100 steps), so any checkpoint comes from the stop
    results = run_ranks(workers.signalled_job, 2, str(stopped_dir), STEPS, 100, 1, 3, timeout_s=240)
    assert [r["stopped_by"] for r in results] == ["SIGUSR2", "SIGUSR2"]
    assert [r["final_step"] for r in results] == [2, 2]
    assert [r["export_path"] for r in results] == [None, None], "an interrupted run is not exported"
    root = stopped_dir / "checkpoints"
    assert list_steps(root).newest_complete == 2 and read_latest(root) == root / "step-2"
    assert read_marker(root / "step-2")["async"] is False and read_marker(root / "step-2")["world_size"] == 2
    trainer = json.loads((root / "step-2" / "trainer.json").read_text())
    assert trainer["step"] == 2 and trainer["sampler"]["num_consumed"] == 2 * 8
    assert [r["step"] for r in _metrics(stopped_dir)] == [1, 2]
    assert not (stopped_dir / "export").exists()

    resumed = run_ranks(workers.train_job, 2, str(stopped_dir), STEPS, 100, timeout_s=240)
    assert [(r["start_step"], r["final_step"], r["stopped_by"]) for r in resumed] == [(2, STEPS, None)] * 2
    _same_steps(_metrics(run_dir), _metrics(stopped_dir))


# ---- resume on another world size: the start step, and the sampler neither repeats nor skips ----
def _num_frames() -> int:
    return json.loads((workers.FIXTURE / "meta" / "info.json").read_text())["total_frames"]


@pytest.mark.parametrize("world_size", [1, pytest.param(3, marks=pytest.mark.slow)])  # 3 ranks on 2 cores: ~3 s
def test_resume_on_another_world_size_continues_the_same_sample_order(full_run, tmp_path, world_size):
    run_dir, full_results = full_run
    resumed = tmp_path / f"resumed_w{world_size}"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_dir / "checkpoints" / "step-2", resumed / "checkpoints" / "step-2")
    results = run_ranks(workers.train_job, world_size, str(resumed), STEPS, EVERY, timeout_s=300)
    assert [(r["start_step"], r["final_step"]) for r in results] == [(2, STEPS)] * world_size

    per_rank_step = 2 * 2  # micro-batch 2 x 2 micro-batches, on every world size (global batch 4 x ranks)
    done = 2 * 2 * per_rank_step  # positions of the epoch's permutation steps 1-2 consumed on 2 ranks
    total = done + (STEPS - 2) * world_size * per_rank_step
    order = epoch_permutation(np.arange(total), num_samples=_num_frames(), seed=3, epoch=0).tolist()
    before = [r["drawn"][:2 * per_rank_step] for r in full_results]
    after = [r["drawn"] for r in results]
    # the 2-rank run dealt positions 0..done-1 round-robin; the resumed run deals the rest to its own ranks
    assert before == [order[rank:done:2] for rank in range(2)]
    assert after == [order[done + rank::world_size] for rank in range(world_size)]
    drawn = [i for ranks in (before, after) for indices in ranks for i in indices]
    assert sorted(drawn) == sorted(order) and len(set(drawn)) == total, "a sample repeated or skipped"
    trainer = json.loads((resumed / "checkpoints" / "step-4" / "trainer.json").read_text())
    assert trainer["sampler"]["num_consumed"] == total


def test_a_gpu_rank_makes_its_local_gpu_current_before_anything_else(fake_cuda, tmp_path):
    """Global rank 3 with local rank 1 on a node of 2 GPUs (tests/cuda_doubles.py): cuda:1 becomes current before
    the loop touches the process group (here there is none, so the loop stops right there) or allocates."""
    cuda = fake_cuda(2)
    cfg = workers.recipe(4, steps=1, every_steps=1)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, warmup_steps=0))  # 1 step: no warm-up
    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        train(cfg, resolve(cfg), run_dir=tmp_path, dist_env=SimpleNamespace(rank=3, world_size=4, local_rank=1),
              device="cuda")
    assert cuda.events == [("set_device", 1)]
