from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from embodyhpc.config.schema import DataConfig, ModelConfig
from embodyhpc.data import open_dataset
from embodyhpc.data.loader import build_dataloader
from embodyhpc.models import build_tokenizer
from embodyhpc.models.pi05 import Pi05Batch
from embodyhpc.models.pi05.batching import Pi05Collate

FIXTURE = Path(__file__).parent / "fixtures" / "lerobot_v30_sample"


def test_loader_with_workers_covers_this_ranks_share_and_persists():
    dataset = open_dataset(FIXTURE, {"action": [0.0, 0.1, 0.2]})
    data = DataConfig(format="lerobot", root=str(FIXTURE), num_workers=2, prefetch_factor=2)
    shares = []
    for rank in range(2):
        loader, sampler = build_dataloader(dataset, data, micro_batch_size=4, rank=rank, world_size=2, seed=3)
        assert loader.persistent_workers and loader.prefetch_factor == 2 and not loader.pin_memory
        batches = list(loader)
        assert all(b["action"].shape == (4, 3, 4) and b["observation.images.top"].dtype == torch.float32
                   for b in batches)
        shares.append({int(i) for b in batches for i in b["index"]})
        assert len(batches) == 60 // 4  # 120 frames / 2 ranks, full batches only
    assert not shares[0] & shares[1] and len(shares[0] | shares[1]) == 120


def test_workers_outlive_the_signals_slurm_sends_every_process_of_a_step():
    """scancel (SIGTERM) and the time-limit warning (SIGUSR2) reach the workers too; the training process stops and
    saves at a step boundary, so the workers must keep serving until then."""
    import os
    import signal

    dataset = open_dataset(FIXTURE, {"action": [0.0, 0.1, 0.2]})
    data = DataConfig(format="lerobot", root=str(FIXTURE), num_workers=2, prefetch_factor=2)
    loader, _ = build_dataloader(dataset, data, micro_batch_size=4, rank=0, world_size=1, seed=3)
    batches = iter(loader)
    next(batches)
    pids = [w.pid for w in loader.worker_processes]
    assert len(pids) == 2
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGUSR2)
    assert len([next(batches) for _ in range(10)]) == 10  # the loader would raise "worker killed by signal"
    assert all(w.is_alive() for w in loader.worker_processes) and [w.pid for w in loader.worker_processes] == pids
    loader.close()  # the training process alone ends them


def test_loader_without_workers():
    dataset = open_dataset(FIXTURE)
    loader, _ = build_dataloader(dataset, DataConfig(format="lerobot", root=str(FIXTURE), num_workers=0),
                                 micro_batch_size=8, rank=0, world_size=1, seed=0)
    assert loader.num_workers == 0 and len(list(loader)) == 15


# ---- the GPU path on CPU (tests/cuda_doubles.py: torch 2.13's DataLoader pin-memory path with a CUDA double) ----
MODEL_CFG = ModelConfig(size="tiny", action_horizon=3, action_dim=8, max_token_len=128, packing=True)
TRAVELLING = [f.name for f in fields(Pi05Batch) if f.name not in ("prompt_lengths", "image_mask", "rows")]


def _pi05_loader(device_type: str, num_workers: int):
    dataset = open_dataset(FIXTURE, {"action": [0.0, 0.1, 0.2]})
    data = DataConfig(format="lerobot", root=str(FIXTURE), num_workers=num_workers, prefetch_factor=2)
    loader, _ = build_dataloader(dataset, data, micro_batch_size=4, rank=0, world_size=1, seed=5,
                                 device_type=device_type,
                                 collate_fn=Pi05Collate(MODEL_CFG, build_tokenizer(MODEL_CFG)))
    return loader


def test_the_loader_pins_only_for_a_gpu_and_leaves_the_device_to_torch():
    assert _pi05_loader("cuda", 0).pin_memory and not _pi05_loader("cpu", 0).pin_memory
    # pin_memory_device is deprecated in torch 2.13 (the current accelerator is used, with a warning if set)
    assert _pi05_loader("cuda", 0).pin_memory_device == ""


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_dataloader_pins_every_travelling_tensor_of_a_pi05_batch(fake_cuda, num_workers):
    """Through torch's own pin path: in the loop for num_workers=0, in its pin-memory thread otherwise."""
    expected = next(iter(_pi05_loader("cpu", num_workers)))
    cuda = fake_cuda(2)
    cuda.set_device(1)  # as the loop does before building the loader: rank with local rank 1
    batch = next(iter(_pi05_loader("cuda", num_workers)))

    assert isinstance(batch, Pi05Batch)
    present = [name for name in TRAVELLING if getattr(batch, name) is not None]
    assert {"images", "prompt_ids", "actions", "action_is_pad", "state"} <= set(present)
    assert [name for name in present if not cuda.is_pinned(getattr(batch, name))] == []
    # host-only fields never travel: not pinned; rows come through as they were
    assert not cuda.is_pinned(batch.prompt_lengths)
    assert batch.rows == expected.rows and batch.rows is not None
    for f in fields(Pi05Batch):
        value, want = getattr(batch, f.name), getattr(expected, f.name)
        assert (torch.equal(value, want) if isinstance(value, torch.Tensor) else value == want), f.name
    if num_workers:  # the pin thread runs on the device that was current when the iterator started
        assert ("accelerator.set_device_index", 1) in cuda.events


def test_pinning_keeps_a_shared_tensor_shared(fake_cuda):
    cuda = fake_cuda(1)
    mask = torch.ones(2, 3, dtype=torch.bool)
    batch = Pi05Batch(images=torch.rand(2, 1, 3, 4, 4), prompt_ids=torch.zeros(2, 5, dtype=torch.long),
                      prompt_lengths=torch.tensor([5, 5]), actions=torch.rand(2, 3, 8), action_is_pad=mask,
                      action_dim_mask=mask, rows=[[0, 1]])
    pinned = batch.pin_memory()
    assert pinned.action_is_pad is pinned.action_dim_mask and cuda.is_pinned(pinned.action_is_pad)
    assert pinned.rows is batch.rows
    assert sum(1 for event in cuda.events if event[0] == "pin") == 4  # images, prompt_ids, actions, the mask


def test_to_copies_travelling_tensors_without_blocking_and_keeps_host_fields():
    batch = next(iter(_pi05_loader("cpu", 0)))
    copies: list[tuple[str, bool]] = []

    class RecordCopies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to:
                copies.append((str(args[1]), bool(kwargs.get("non_blocking"))))
            return func(*args, **kwargs)

    with RecordCopies():
        moved = batch.to("meta")  # a device other than the CPU, available on any machine
    present = [name for name in TRAVELLING if getattr(batch, name) is not None]
    assert copies == [("meta", True)] * len(present)
    assert all(getattr(moved, name).device.type == "meta" for name in present)
    assert moved.prompt_lengths is batch.prompt_lengths and moved.prompt_lengths.device.type == "cpu"
