"""One rank's data fails part-way through training (2 gloo ranks, the tiny pi0.5 on the LeRobot fixture): every rank
raises the same one-line DataWorkerError naming the failing rank within seconds, none is left in a collective, and
no DataLoader worker outlives the loop. With data.on_bad_sample=skip, a bad sample is skipped and the loop logs the
count. The harness fails a case after its timeout instead of hanging (the old loop waited in the next collective)."""

from __future__ import annotations

import re

import pytest

from embodyhpc.train.stream import agree_on_failure
from tests.parallel.harness import run_ranks
from tests.train.data_failure_workers import broken_data_job, scancel_job, side_group_failure_job

BOUND_S = 45.0  # from the failing read to the error on every rank, on this loaded 2-core machine


def _run(tmp_path, fail_rank: int, how: str, num_workers: int, **options) -> list[dict]:
    return run_ranks(broken_data_job, 2, str(tmp_path), fail_rank, how, num_workers, options, timeout_s=240)


@pytest.mark.slow  # the model built and trained on 2 ranks
@pytest.mark.parametrize(("fail_rank", "how", "num_workers", "expected"), [
    (1, "raise", 2, r"rank 1: data worker \d failed reading sample \d+: OSError: sample \d+: unexpected end of file"),
    (0, "chunk", 0, r"rank 0: the training process failed collating a micro-batch: ConfigError: "
                    r"data\.delta_timestamps: the dataset's action chunk has shape \(3, 4\), the model predicts 4"),
    (1, "chunk", 1, r"rank 1: data worker 0 failed collating a micro-batch: ConfigError: data\.delta_timestamps"),
], ids=["rank 1 reading, 2 workers", "rank 0 collating, no workers", "rank 1 collating, 1 worker"])
def test_every_rank_fails_with_the_failing_ranks_error(tmp_path, fail_rank, how, num_workers, expected):
    results = _run(tmp_path, fail_rank, how, num_workers)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert "\n" not in errors[0]
    assert re.fullmatch(expected + r".*", errors[0]), errors[0]
    assert all(r["after_failure_s"] < BOUND_S for r in results), results
    assert [r["live_workers"] for r in results] == [[], []]


@pytest.mark.slow  # the model built and trained on 2 ranks
def test_a_stuck_worker_fails_every_rank_after_the_batch_timeout(tmp_path):
    # long enough that the healthy rank's worker never misses it on this loaded machine, short for a test
    results = _run(tmp_path, 1, "hang", 1, batch_timeout_s=20.0)
    errors = [r["error"] for r in results]
    assert errors[0] == errors[1] and errors[0].startswith(
        "rank 1: no micro-batch from the data workers within data.batch_timeout_s=20 s: a worker is stuck"), errors
    # after the read hung: at most the timeout (the prefetched batches ahead of it come first), then the bound
    assert all(r["after_failure_s"] < 20.0 + BOUND_S for r in results), results
    assert [r["live_workers"] for r in results] == [[], []]  # the sleeping worker ignored SIGTERM: it was killed


@pytest.mark.slow  # the model built and trained on 2 ranks
def test_skip_trains_on_and_logs_the_skipped_count(tmp_path):
    results = _run(tmp_path, 1, "raise", 0, on_bad_sample="skip")
    assert [r["error"] for r in results] == [None, None]
    assert [r["last_metrics"]["data_skipped_samples"] for r in results] == [1.0, 1.0]  # summed over ranks


@pytest.mark.slow  # the model built and trained on 2 ranks
def test_scancel_still_saves_the_step_with_workers_that_outlive_the_signal_and_end_with_the_loop(tmp_path):
    """The workers ignore SIGTERM (a worker killed by it would fail the rank before its save); the loop saves the
    step every rank agreed on, stops, and ends the workers itself."""
    from embodyhpc.checkpoint import list_steps

    results = run_ranks(scancel_job, 2, str(tmp_path), 2, timeout_s=240)
    assert [r["stopped_by"] for r in results] == ["SIGTERM", "SIGTERM"]
    assert [r["final_step"] for r in results] == [2, 2]
    assert list_steps(tmp_path / "checkpoints").newest_complete == 2
    assert all(len(r["signalled_workers"]) == 2 for r in results)
    assert [r["live_workers"] for r in results] == [[], []]


@pytest.mark.slow  # 2 ranks
def test_under_nccl_the_agreement_runs_on_the_gloo_side_group_with_the_process_groups_timeout():
    """A GPU job: the data-failure agreement cannot travel on NCCL; the side group waits as long as the process
    group does (torch would give a new group 30 minutes), so a peer of a stuck rank gives up in bounded time."""
    import inspect

    from embodyhpc.config.schema import COLLECTIVE_TIMEOUT_S
    from embodyhpc.launch.distributed import process_group

    assert inspect.signature(process_group).parameters["timeout_s"].default == COLLECTIVE_TIMEOUT_S
    results = run_ranks(side_group_failure_job, 2)
    assert [r["timeouts"] for r in results] == [[COLLECTIVE_TIMEOUT_S]] * 2
    assert [r["agreed"] for r in results] == ["rank 1: data worker 0 failed reading sample 9: OSError: gone"] * 2
    assert [r["same_object"] for r in results] == [False, True]  # the failing rank raises its own exception
    assert [r["none_failed"] for r in results] == [None, None]
    assert all(r["on_side_group"] for r in results)


def test_without_a_process_group_the_failure_is_this_processs_own():
    from embodyhpc.data.errors import DataWorkerError

    failure = DataWorkerError("rank 0: data worker 1 failed reading sample 3: OSError: gone")
    assert agree_on_failure(failure) is failure and agree_on_failure(None) is None
