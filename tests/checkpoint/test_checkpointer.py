"""The Checkpointer in one process (no process group): async saves and their marker, crash leftovers, retention,
`latest` under concurrent readers, RNG and trainer state. The multi-rank behaviour is in test_reshard/test_resume.
"""

from __future__ import annotations

import random
import re
import shutil
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from embodyhpc.checkpoint import Checkpointer, CheckpointError, layout, rng
from embodyhpc.config.schema import CheckpointConfig

# DCP says so on every call without a process group, which is exactly the mode under test here
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model, optimizer, num_steps=1):
    for _ in range(num_steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _checkpointer(root, keep=2, async_save=True):
    return Checkpointer(root, CheckpointConfig(every_steps=1, keep_latest_k=keep, async_save=async_save))


@pytest.fixture
def gated_async_save(monkeypatch):
    """dcp.async_save whose future completes only once the returned event is set: a save held in flight."""
    gate = threading.Event()
    real_async_save = dcp.async_save

    def gated(*args, **kwargs):
        inner = real_async_save(*args, **kwargs)
        outer: Future = Future()

        def relay():
            gate.wait(60)
            try:
                outer.set_result(inner.result())
            except Exception as exc:
                outer.set_exception(exc)

        threading.Thread(target=relay, daemon=True).start()
        return outer

    monkeypatch.setattr(dcp, "async_save", gated)
    return gate


def test_async_save_returns_at_once_and_counts_only_after_its_marker(tmp_path, gated_async_save):
    model, optimizer = _model_and_optimizer()
    ckpt = _checkpointer(tmp_path)
    _train(model, optimizer)
    ckpt.save(1, model, optimizer, blocking=True)
    _train(model, optimizer)
    saved = {k: v.clone() for k, v in model.state_dict().items()}

    result = ckpt.save(2, model, optimizer, sampler_state={"epoch": 0, "num_consumed": 8})
    assert result.is_async and result.stall_s >= 0  # returned while the gated write is still held: in flight
    # in flight: the folder is there, unmarked; nothing points at it; a restart would take step 1
    _train(model, optimizer)  # the loop goes on and changes the parameters under the save
    assert ckpt.in_flight_step == 2
    assert result.folder.is_dir() and not layout.is_complete(result.folder)
    assert layout.list_steps(tmp_path).complete == [1]
    assert layout.read_latest(tmp_path) == tmp_path / "step-1"
    assert _checkpointer(tmp_path).newest_complete_step() == 1

    gated_async_save.set()
    ckpt.wait()
    marker = layout.read_marker(result.folder)
    assert marker["step"] == 2 and marker["world_size"] == 1 and marker["async"] is True
    assert marker["wall_s"] >= marker["stall_s"] >= 0
    assert layout.read_latest(tmp_path) == result.folder

    fresh_model, fresh_optimizer = _model_and_optimizer()
    loaded = _checkpointer(tmp_path).load_latest(fresh_model, fresh_optimizer)
    assert loaded.step == 2 and loaded.trainer.sampler == {"epoch": 0, "num_consumed": 8}
    for key, value in fresh_model.state_dict().items():
        assert torch.equal(value, saved[key]), f"{key}: the save holds the values of the moment it was called"
    ckpt.close()


def test_crash_leftovers_are_ignored_at_resume_and_removed_by_the_next_save(tmp_path):
    model, optimizer = _model_and_optimizer()
    ckpt = _checkpointer(tmp_path, async_save=False)
    _train(model, optimizer)
    ckpt.save(2, model, optimizer)
    # a job died while writing step 5 (all data there, no marker), and another while writing step 3
    shutil.copytree(tmp_path / "step-2", tmp_path / "step-5")
    (tmp_path / "step-5" / layout.MARKER).unlink()
    (tmp_path / "step-3").mkdir()
    (tmp_path / "step-3" / "__0_0.distcp").write_bytes(b"half a file")

    fresh_model, fresh_optimizer = _model_and_optimizer()
    loaded = _checkpointer(tmp_path).load_latest(fresh_model, fresh_optimizer)
    assert loaded.step == 2
    assert layout.list_steps(tmp_path).incomplete == [3, 5], "loading deletes nothing"

    _train(model, optimizer)
    ckpt.save(3, model, optimizer)  # replaces the leftover of its own step, then retention removes step-5
    assert layout.list_steps(tmp_path) == layout.Listing(complete=[2, 3], incomplete=[])
    assert sorted(p.name for p in (tmp_path / "step-3").iterdir()) == [
        ".complete", ".metadata", "__0_0.distcp", "rng", "trainer.json"]
    with pytest.raises(CheckpointError, match="never completely written"):
        (tmp_path / "step-3" / layout.MARKER).unlink()
        _checkpointer(tmp_path).load(3, fresh_model, fresh_optimizer)


def test_retention_keeps_the_newest_k_and_deletes_nothing_while_a_save_is_in_flight(tmp_path, gated_async_save):
    model, optimizer = _model_and_optimizer()
    ckpt = _checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        _train(model, optimizer)
        ckpt.save(step, model, optimizer, blocking=True)
    assert layout.list_steps(tmp_path).complete == [2, 3]

    _train(model, optimizer)
    ckpt.save(4, model, optimizer)
    assert layout.list_steps(tmp_path) == layout.Listing(complete=[2, 3], incomplete=[4])
    gated_async_save.set()
    ckpt.wait()
    assert layout.list_steps(tmp_path) == layout.Listing(complete=[3, 4], incomplete=[])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-3", "step-4"], "no temporary files left"
    ckpt.close()


def test_latest_always_names_a_complete_folder_while_saves_run(tmp_path):
    model, optimizer = _model_and_optimizer()
    ckpt = _checkpointer(tmp_path, keep=2)
    ckpt.save(0, model, optimizer, blocking=True)
    observations, stop = [], threading.Event()

    def watch():  # looks every millisecond: a loop without a wait holds the GIL, and on a busy or one-core machine
        # the saver's thread then waits seconds to start (Thread.start waits for it), so the test ran for minutes
        while not stop.wait(0.001):
            text = (tmp_path / "latest").read_text()
            folder = tmp_path / text.strip()
            newest = layout.list_steps(tmp_path).newest_complete
            observations.append((text, layout.is_complete(folder) or not folder.exists(), newest))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for step in range(1, 7):
            _train(model, optimizer)
            ckpt.save(step, model, optimizer)
        ckpt.close()
    finally:
        stop.set()
        watcher.join()
    assert observations  # the watcher looked while saves ran (how often is the machine's speed)
    for text, complete_or_retired, _ in observations:
        assert re.fullmatch(r"step-\d+\n", text), f"partial `latest`: {text!r}"
        assert complete_or_retired, f"`latest` named an unmarked folder: {text!r}"
    assert (tmp_path / "latest").read_text() == "step-6\n"
    assert layout.list_steps(tmp_path).complete == [5, 6]


def test_a_second_save_of_a_complete_step_is_skipped(tmp_path):
    model, optimizer = _model_and_optimizer()
    ckpt = _checkpointer(tmp_path, async_save=False)
    first = ckpt.save(7, model, optimizer)
    marker = layout.read_marker(first.folder)
    again = ckpt.save(7, model, optimizer)  # e.g. preempted right after resuming from step 7
    assert again.skipped and not first.skipped
    assert layout.read_marker(first.folder) == marker


def test_trainer_state_must_be_json_and_a_failed_save_stays_unmarked(tmp_path):
    model, optimizer = _model_and_optimizer()
    ckpt = _checkpointer(tmp_path, async_save=False)
    with pytest.raises(CheckpointError, match="JSON"):
        ckpt.save(1, model, optimizer, extra={"tensor": torch.zeros(1)})
    assert layout.list_steps(tmp_path).complete == []
    assert layout.read_latest(tmp_path) is None


def test_rng_state_round_trips_through_its_file(tmp_path):
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    np.random.normal()  # leaves a cached gaussian in numpy's state
    state = rng.capture_rng_state()
    rng.save_rng_file(tmp_path / "rank-00000.pt", state)
    expected = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.normal(size=3))

    rng.reseed(99)
    rng.restore_rng_state(rng.load_rng_file(tmp_path / "rank-00000.pt"))  # weights_only=True load
    actual = (torch.rand(3), random.random(), random.gauss(0, 1), np.random.normal(size=3))
    assert torch.equal(expected[0], actual[0])
    assert expected[1:3] == actual[1:3]
    assert np.array_equal(expected[3], actual[3])


def test_derived_seeds_differ_per_rank_and_step_and_repeat():
    seeds = {rng.derived_seed(0, step, rank) for step in range(3) for rank in range(4)}
    assert len(seeds) == 12
    assert rng.derived_seed(1, 2, 3) == rng.derived_seed(1, 2, 3)
    assert all(0 <= seed < 2**63 for seed in seeds)


def test_a_pinned_folder_outlives_retention_until_unpinned(tmp_path):
    """An evaluation waiting to export step-1 pins it: retention skips it, and removes it once it is unpinned."""
    model, optimizer = _model_and_optimizer()
    completed = []

    def on_complete(step, folder):
        completed.append(step)
        if step == 1:
            layout.pin(folder, owner=tmp_path / "evals" / "step-1")

    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep_latest_k=2), on_complete=on_complete) as ckpt:
        for step in range(1, 5):
            _train(model, optimizer)
            ckpt.save(step, model, optimizer)
        ckpt.wait()
        assert completed == [1, 2, 3, 4]
        assert layout.list_steps(tmp_path).complete == [1, 3, 4]  # 2 went; pinned 1 stayed
        assert layout.pinned_by(tmp_path / "step-1") == [str(tmp_path / "evals" / "step-1")]
        layout.unpin(tmp_path / "step-1", owner=tmp_path / "evals" / "step-1")
        layout.unpin(tmp_path / "step-1", owner=tmp_path / "evals" / "step-1")  # twice is fine
        _train(model, optimizer)
        ckpt.save(5, model, optimizer, blocking=True)
    assert layout.list_steps(tmp_path).complete == [4, 5]


def test_a_failing_on_complete_never_fails_the_save(tmp_path, caplog):
    model, optimizer = _model_and_optimizer()

    def broken(step, folder):
        raise RuntimeError("sbatch: error: Batch job submission failed")

    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep_latest_k=2), on_complete=broken) as ckpt:
        ckpt.save(1, model, optimizer)
        ckpt.save(2, model, optimizer, blocking=True)
    assert layout.list_steps(tmp_path).complete == [1, 2]
    assert "on_complete failed" in caplog.text and "Batch job submission failed" in caplog.text


# ---- the GPU branches on CPU, with tests/cuda_doubles.py (torch 2.13's torch.cuda / DCP staging API) ----
def test_the_cuda_rng_stream_of_the_ranks_gpu_round_trips_through_a_checkpoint(tmp_path, fake_cuda, caplog):
    cuda = fake_cuda(2)
    cuda.set_device(1)  # this rank's GPU (the loop makes it current first)
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer)
    cuda.draw(1)
    saved, other = cuda.rng_states[1].clone(), cuda.rng_states[0].clone()
    with _checkpointer(tmp_path) as ckpt:
        ckpt.save(1, model, optimizer, blocking=True)
    state = rng.load_rng_file(layout.rng_file(layout.step_dir(tmp_path, 1), 0))
    assert torch.equal(state["cuda"], saved)  # the current device's stream, not device 0's

    model2, optimizer2 = _model_and_optimizer()  # torch.manual_seed: reseeds every device, as the real one does
    for device in (1, 1, 0):  # device 0's stream moves too; restoring must leave it alone
        cuda.draw(device)
    drawn_other = cuda.rng_states[0].clone()
    assert not torch.equal(cuda.rng_states[1], saved) and not torch.equal(drawn_other, other)
    with _checkpointer(tmp_path) as ckpt:
        assert ckpt.load_latest(model2, optimizer2).rng_restored
    assert torch.equal(cuda.rng_states[1], saved) and torch.equal(cuda.rng_states[0], drawn_other)
    assert [e for e in cuda.events if e[0] == "set_rng_state"] == [("set_rng_state", 1)]
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_rank_that_never_initialised_cuda_captures_no_cuda_stream(fake_cuda):
    cuda = fake_cuda(2, initialized=False)  # a CPU run on a GPU node: capturing must not initialise CUDA for it
    assert "cuda" not in rng.capture_rng_state() and not cuda.initialized


def _save_step_1(root) -> torch.Tensor:
    """Save step 1; returns the CPU stream's next draws after the save (what a resume must draw again)."""
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer)
    with _checkpointer(root) as ckpt:
        ckpt.save(1, model, optimizer, blocking=True)
    return torch.rand(3)


def _resume_warnings(root, caplog, expected_cpu_draws: torch.Tensor) -> list[str]:
    caplog.clear()
    model, optimizer = _model_and_optimizer()
    with _checkpointer(root) as ckpt:
        ckpt.load_latest(model, optimizer)
    assert torch.equal(torch.rand(3), expected_cpu_draws)  # the CPU stream continues whatever the CUDA one does
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def test_a_gpu_checkpoint_resumed_without_a_gpu_says_so_in_one_line(tmp_path, fake_cuda, monkeypatch, caplog):
    fake_cuda(1)
    expected = _save_step_1(tmp_path)
    assert "cuda" in rng.load_rng_file(layout.rng_file(layout.step_dir(tmp_path, 1), 0))
    monkeypatch.undo()  # the CPU machine it really is
    warnings = _resume_warnings(tmp_path, caplog, expected)
    assert warnings == ["step-1, rank 0: the checkpoint holds a CUDA RNG stream but this rank has no GPU: it is "
                        "not restored"]


def test_a_cpu_checkpoint_resumed_on_a_gpu_says_so_in_one_line(tmp_path, fake_cuda, caplog):
    expected = _save_step_1(tmp_path)
    assert "cuda" not in rng.load_rng_file(layout.rng_file(layout.step_dir(tmp_path, 1), 0))
    cuda = fake_cuda(2)
    warnings = _resume_warnings(tmp_path, caplog, expected)
    assert len(warnings) == 1 and "no CUDA RNG stream" in warnings[0] and "\n" not in warnings[0]
    assert not [e for e in cuda.events if e[0] == "set_rng_state"]


def _staged_storages(model, optimizer) -> int:
    """Distinct storages of the DCP state large enough for DCP to pin (>= 5 bytes: the AdamW step counters are not)."""
    from embodyhpc.checkpoint.state import model_and_optim_state

    tensors = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(model_and_optim_state(model, optimizer))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(1 for nbytes in storages.values() if nbytes >= 5)


def test_async_saves_on_a_gpu_stage_into_pinned_buffers_reused_by_every_save(tmp_path, fake_cuda):
    """DCP's DefaultStager with the Checkpointer's GPU options, run through dcp.async_save: the staging buffers are
    registered (cudaHostRegister) once, the copies are followed by one synchronize per save, and the data written
    is exact; close() unpins everything."""
    import gc

    cuda = fake_cuda(2)
    cuda.set_device(1)
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer)
    expected_pins = _staged_storages(model, optimizer)
    ckpt = Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep_latest_k=3, async_save=True),
                        device=torch.device("cuda", 1))
    for step in (1, 2):
        before = len(cuda.events)
        ckpt.save(step, model, optimizer)
        ckpt.wait()
        kinds = [e[0] for e in cuda.events[before:]]
        assert kinds.count("synchronize") == 1  # after the copies of this save, before the write
        assert cuda.num_host_registrations == expected_pins  # the first save pins; the second reuses
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        _train(model, optimizer)
    ckpt.close()
    gc.collect()
    assert cuda.host_registered == {}  # every buffer unpinned once the stager lets go

    restored, restored_optimizer = _model_and_optimizer()
    with _checkpointer(tmp_path) as loader:
        loader.load(2, restored, restored_optimizer)
    assert all(torch.equal(restored.state_dict()[k], v) for k, v in reference.items())


def test_a_cpu_run_on_a_gpu_node_stages_without_pinning(tmp_path, fake_cuda):
    cuda = fake_cuda(2)
    model, optimizer = _model_and_optimizer()
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep_latest_k=3, async_save=True),
                      device="cpu") as ckpt:
        ckpt.save(1, model, optimizer)
    assert cuda.num_host_registrations == 0 and ("synchronize",) not in cuda.events


def test_a_checkpoint_that_does_not_fit_fails_the_load_as_an_exception_in_one_line(tmp_path):
    """DCP's CheckpointException is a BaseException (torch 2.13: it passes `except Exception` handlers, where the
    job writes its reason); the checkpointer turns it into a CheckpointError naming the folder and DCP's last line."""
    model, optimizer = _model_and_optimizer()
    _train(model, optimizer)
    with _checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, model, optimizer)
    wider = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with _checkpointer(tmp_path) as ckpt, pytest.raises(CheckpointError) as caught:
        ckpt.load(1, wider, torch.optim.AdamW(wider.parameters()))
    message = str(caught.value)
    assert "\n" not in message and "step-1 cannot be loaded into this model" in message
    assert "Size mismatch" in message and isinstance(caught.value, Exception)
