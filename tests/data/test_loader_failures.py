"""The training DataLoader when its data or its workers fail: one DataWorkerError within seconds, on one line, naming
the rank, the worker and the error; bad samples skipped and counted only when asked; workers that ignore SIGTERM
(they must outlive Slurm's signals) still end with the training process, whichever way it ends, and a process that
fails never hangs at exit waiting for them (the hang cases run in a subprocess with a hard timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from embodyhpc.config.schema import DataConfig
from embodyhpc.data.errors import DataWorkerError
from embodyhpc.data.guard import LOGGED_SKIPS_PER_WORKER
from embodyhpc.data.loader import MAX_SKIPPED_BATCHES_IN_A_ROW, TrainingLoader, build_dataloader
from embodyhpc.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
NUM_SAMPLES = 64
MICRO_BATCH = 4


class Numbers(torch.utils.data.Dataset):
    """Sample i is tensor([i]); `bad` indices raise `error` (a bad sample, unless the error says otherwise)."""

    def __init__(self, bad: set[int] = frozenset(), error: type[Exception] = OSError, sleep_on: int | None = None,
                 die_on: int | None = None) -> None:
        self.bad, self.error, self.sleep_on, self.die_on = set(bad), error, sleep_on, die_on

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == self.sleep_on:
            time.sleep(3600)  # a read that never returns (a hung file system)
        if index == self.die_on:
            os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer's way
        if index in self.bad:
            if issubclass(self.error, ConfigError):
                raise ConfigError(f"sample {index} is configured wrong", key="model.state_key", fix="name another")
            raise self.error(f"cannot read sample {index}:\n  unexpected end of file")
        return torch.tensor([index])


def _loader(dataset, *, workers: int = 2, on_bad_sample: str = "error", timeout_s: float = 60.0,
            collate=None) -> TrainingLoader:
    data = DataConfig(num_workers=workers, on_bad_sample=on_bad_sample, batch_timeout_s=timeout_s)
    loader, _ = build_dataloader(dataset, data, micro_batch_size=MICRO_BATCH, rank=0, world_size=1, seed=0,
                                 collate_fn=collate)
    return loader


def _drain(loader: TrainingLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch.flatten()]


@pytest.fixture
def closing():
    """Close the loaders a test made, whatever it asserted (their workers ignore SIGTERM)."""
    made: list[TrainingLoader] = []
    yield made.append
    for loader in made:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_the_dataset_cannot_read_fails_with_one_line_naming_rank_worker_and_sample(workers, closing):
    loader = _loader(Numbers(bad={37}), workers=workers)
    closing(loader)
    started = time.monotonic()
    with pytest.raises(DataWorkerError) as raised:
        _drain(loader)
    message = str(raised.value)
    assert time.monotonic() - started < 10
    assert "\n" not in message and message.startswith("rank 0: ")
    assert "failed reading sample 37: OSError: cannot read sample 37: unexpected end of file" in message
    assert ("the training process" if workers == 0 else "data worker ") in message


@pytest.mark.parametrize("on_bad_sample", ["error", "skip"])
def test_a_collate_error_is_the_recipes_and_is_never_skipped(on_bad_sample, closing):
    def collate(items):
        raise ConfigError("the dataset's action chunk has shape (4, 4), the model predicts 5 steps",
                          key="data.delta_timestamps", fix="set data.delta_timestamps.action to 5 offsets")

    loader = _loader(Numbers(), on_bad_sample=on_bad_sample, collate=collate)
    closing(loader)
    with pytest.raises(DataWorkerError, match=r"failed collating a micro-batch: ConfigError: data\.delta_timestamps: "
                                              r"the dataset's action chunk .* \(fix: set data\.delta_timestamps"):
        _drain(loader)


def test_a_config_error_while_reading_is_not_a_bad_sample(closing):
    loader = _loader(Numbers(bad={5}, error=ConfigError), on_bad_sample="skip")
    closing(loader)
    with pytest.raises(DataWorkerError, match="failed reading sample 5: ConfigError: model.state_key"):
        _drain(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_drops_bad_samples_counts_them_and_names_them_on_the_log(workers, closing, capfd):
    bad = {0, 9, 10, 11, 12, 40}  # 9..12 may fill one micro-batch on its own: the batch is skipped whole
    loader = _loader(Numbers(bad=bad), workers=workers, on_bad_sample="skip")
    closing(loader)
    seen = _drain(loader)
    assert sorted(seen) == sorted(set(range(NUM_SAMPLES)) - bad)
    assert loader.skipped_samples == len(bad)
    log = capfd.readouterr().err
    assert sum("skipped a bad sample (data.on_bad_sample=skip): sample " in line for line in log.splitlines()) == 6
    assert "OSError: cannot read sample 40: unexpected end of file" in log


def test_skip_names_a_bounded_number_of_samples_and_counts_the_rest(closing, capfd):
    bad = set(range(0, NUM_SAMPLES, 2))
    loader = _loader(Numbers(bad=bad), workers=0, on_bad_sample="skip")
    closing(loader)
    assert len(_drain(loader)) == NUM_SAMPLES - len(bad) and loader.skipped_samples == len(bad)
    lines = [line for line in capfd.readouterr().err.splitlines() if "skipped a bad sample" in line]
    assert len(lines) == LOGGED_SKIPS_PER_WORKER < len(bad)


def test_a_dataset_with_no_readable_sample_fails_instead_of_skipping_forever(closing):
    loader = _loader(Numbers(bad=set(range(NUM_SAMPLES))), workers=2, on_bad_sample="skip")
    closing(loader)
    with pytest.raises(DataWorkerError, match=f"{MAX_SKIPPED_BATCHES_IN_A_ROW} micro-batches in a row had no "
                                              "readable sample"):
        _drain(loader)


@pytest.mark.slow  # the timeout, then torch's shutdown waits on the stuck worker (5 s) before close kills it
def test_a_stuck_worker_fails_the_batch_after_the_timeout_and_close_kills_it(closing):
    loader = _loader(Numbers(sleep_on=17), workers=2, timeout_s=2)
    closing(loader)
    started = time.monotonic()
    with pytest.raises(DataWorkerError, match=r"rank 0: no micro-batch from the data workers within "
                                              r"data\.batch_timeout_s=2 s: a worker is stuck"):
        _drain(loader)
    assert time.monotonic() - started < 30
    workers = loader.worker_processes
    assert len(workers) == 2 and any(w.is_alive() for w in workers)  # one sleeps, SIGTERM would not end it
    closed = time.monotonic()
    loader.close()
    assert not any(w.is_alive() for w in workers) and time.monotonic() - closed < 30
    assert loader.worker_processes == []


def test_a_worker_killed_by_a_signal_is_an_error_not_a_wait(closing):
    loader = _loader(Numbers(die_on=21), workers=2)
    closing(loader)
    with pytest.raises(RuntimeError, match=r"(?s)worker.*(killed by signal|exited unexpectedly)"):
        _drain(loader)


def test_a_failure_travels_through_the_pin_memory_thread_of_a_gpu_rank(fake_cuda, closing):
    """pin_memory=True (a CUDA rank, torch's pin thread on the CUDA double): the record passes the thread unchanged
    and the good batches before it come out pinned."""
    cuda = fake_cuda(1)
    data = DataConfig(num_workers=2, batch_timeout_s=60)
    loader, _ = build_dataloader(Numbers(bad={50}), data, micro_batch_size=MICRO_BATCH, rank=0, world_size=1,
                                 seed=0, device_type="cuda")
    closing(loader)
    assert loader.pin_memory
    pinned = []
    with pytest.raises(DataWorkerError, match="failed reading sample 50: OSError"):
        for batch in loader:
            pinned.append(cuda.is_pinned(batch))
    assert pinned and all(pinned)


def test_close_ends_workers_that_ignore_sigterm_and_a_later_epoch_starts_new_ones(closing):
    loader = _loader(Numbers(), workers=2)
    closing(loader)
    first = iter(loader)
    next(first)
    workers = loader.worker_processes
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    loader.close()
    assert not any(w.is_alive() for w in workers)
    assert len(_drain(loader)) == NUM_SAMPLES  # iterating again starts a fresh set of workers
    assert {w.pid for w in loader.worker_processes}.isdisjoint({w.pid for w in workers})


def test_torch_iterator_has_what_close_relies_on():
    """close() uses torch's private `_workers` and `_shutdown_workers` of the multi-process iterator: this fails
    when a torch upgrade renames them (close would then leave the workers to the exit hook)."""
    loader = _loader(Numbers(), workers=1)
    iterator = torch.utils.data.DataLoader.__iter__(loader)
    try:
        assert isinstance(iterator._workers, list) and callable(iterator._shutdown_workers)
    finally:
        iterator._shutdown_workers()
        for worker in iterator._workers:
            worker.kill()


# ---- whole processes: the hang at exit, and a training process killed outright ----
SCRIPT = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    from tests.data.test_loader_failures import Numbers, _loader
    loader = _loader(Numbers(bad={{30}}, sleep_on={sleep_on}), workers=2)
    batches = iter(loader)  # starts the workers
    print("workers", *[w.pid for w in loader.worker_processes], flush=True)
    {then}
""")


def _script(tmp_path: Path, then: str, sleep_on: int | None = None) -> subprocess.Popen:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT.format(repo=str(REPO), then=then, sleep_on=sleep_on))
    return subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _worker_pids(stdout: str) -> list[int]:
    return [int(p) for line in stdout.splitlines() if line.startswith("workers") for p in line.split()[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("then", [
    "[next(batches) for _ in range(100)]",  # the worker's error propagates: sys.exit with a traceback
    "next(batches); sys.exit(3)",  # the process stops with the loader still open (no error from it)
])
def test_a_process_that_fails_with_workers_still_running_exits_at_once(tmp_path, then):
    proc = _script(tmp_path, then)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        for pid in _worker_pids(out):  # the workers ignore SIGTERM: end them here, not leave them to the machine
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the process did not exit within 60 s (it waits for its DataLoader workers): {err[-2000:]}")
    assert proc.returncode in (1, 3), err
    if "range(100)" in then:
        assert "DataWorkerError: rank 0: data worker" in err and "OSError: cannot read sample 30" in err
    assert not [pid for pid in _worker_pids(out) if _alive(pid)]


@pytest.mark.slow
def test_workers_die_with_a_training_process_killed_outright(tmp_path):
    """SIGKILL of the training process (the OOM killer, scancel's last word): a worker stuck in a read (which would
    see its parent gone only at its next index request) is killed by the kernel."""
    proc = _script(tmp_path, "next(batches); time.sleep(3600)", sleep_on=9)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while time.monotonic() < deadline and not line.startswith("workers"):
            line = proc.stdout.readline()
        pids = _worker_pids(line)
        assert len(pids) == 2, proc.stderr.read() if proc.poll() is not None else line
        time.sleep(1.0)  # the worker that drew sample 9 is now asleep in it
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        left = [pid for pid in pids if _alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert left == []
    finally:
        if proc.poll() is None:
            proc.kill()
