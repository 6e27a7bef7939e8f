from __future__ import annotations

from pathlib import Path

import torch

from embodyhpc.config.schema import DataConfig
from embodyhpc.data import open_dataset
from embodyhpc.data.loader import build_dataloader

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


def test_loader_without_workers():
    dataset = open_dataset(FIXTURE)
    loader, _ = build_dataloader(dataset, DataConfig(format="lerobot", root=str(FIXTURE), num_workers=0),
                                 micro_batch_size=8, rank=0, world_size=1, seed=0)
    assert loader.num_workers == 0 and len(list(loader)) == 15
