"""Batched decoding (LeRobotV3Dataset.__getitems__: one decode call per video file per micro-batch) returns exactly
what per-sample decoding returns (`dataset[i]`, itself held to LeRobot 0.4.4's items in test_lerobot.py), for random
index sets that cross GOPs (the v3.0 sample: all episodes in one file per camera) and files (the v2.1 sample: a file
per episode); a file that fails is read per sample, so the bad sample alone is named; and the loader's sample order
and resume are the StepSampler's formula (epoch_permutation), whatever the image dtype.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from embodyhpc.config.schema import DataConfig
from embodyhpc.data import open_dataset
from embodyhpc.data.guard import BadSample, GuardedDataset
from embodyhpc.data.loader import build_dataloader
from embodyhpc.data.sampler import epoch_permutation
from tests.data.conftest import FIXTURES, writable_copy

V21_ROOT = FIXTURES / "lerobot_v21_sample"


def _assert_same_items(batched: list[dict], single: list[dict]) -> None:
    assert len(batched) == len(single)
    for got, want in zip(batched, single, strict=True):
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
            else:
                assert got[key] == value, key


class CountingDecoder:
    """The dataset's real decoder, counting its calls per file."""

    def __init__(self, decoder) -> None:
        self.decoder, self.calls = decoder, []

    def __getattr__(self, name):
        return getattr(self.decoder, name)

    def decode(self, path, times_s):
        self.calls.append(str(path))
        return self.decoder.decode(path, times_s)


@pytest.mark.parametrize("backend", ["torchcodec", "pyav"])
@pytest.mark.parametrize(("root", "delta"), [
    ("v30", {"observation.images.wrist": [-0.1, 0.0], "observation.images.top": [0.0], "action": [0.0, 0.1]}),
    ("v21", {"observation.images.cam": [-0.2, -0.1, 0.0], "action": [0.0, 0.1]}),
])
def test_batched_decoding_returns_the_per_sample_frames(sample_root, root, delta, backend):
    path = sample_root if root == "v30" else V21_ROOT
    dataset = open_dataset(path, delta, video_backend=backend, image_dtype="uint8")
    rng = np.random.default_rng(7)
    index_sets = [rng.integers(0, len(dataset), size=12).tolist() for _ in range(2)]  # repeats allowed
    index_sets.append([0, len(dataset) - 1, 1, len(dataset) - 2])  # both ends of the dataset, out of order
    single = {i: dataset[i] for s in index_sets for i in s}
    dataset.decoder = counting = CountingDecoder(dataset.decoder)
    for indices in index_sets:
        counting.calls.clear()
        _assert_same_items(dataset.__getitems__(indices), [single[i] for i in indices])
        # one call per (camera, file) the batch touches
        assert len(counting.calls) == len(set(counting.calls))


def test_a_failing_file_is_read_per_sample_and_only_its_samples_are_bad(tmp_path):
    root = writable_copy(V21_ROOT, tmp_path / "v21")
    dataset = open_dataset(root, {"observation.images.cam": [-0.1, 0.0]}, video_backend="pyav", image_dtype="uint8")
    broken = dataset.video_path("observation.images.cam", 1)
    good = {i: dataset[i] for i in range(len(dataset))}
    shutil.copyfile(broken, broken.with_suffix(".bak"))
    broken.write_bytes(broken.read_bytes()[:200])  # truncated: episode 1's file cannot be decoded
    dataset.decoder.close()
    first, end = int(dataset._episodes["dataset_from_index"][1]), int(dataset._episodes["dataset_to_index"][1])
    indices = [0, first, end - 1, end, len(dataset) - 1]
    items = GuardedDataset(dataset).__getitems__(indices)
    for index, item in zip(indices, items, strict=True):
        if first <= index < end:
            assert isinstance(item, BadSample) and item.index == index and "episode 1" in item.error
        else:
            _assert_same_items([item], [good[index]])


@pytest.mark.parametrize("image_dtype", ["float32", "uint8"])
def test_the_loader_draws_the_samplers_order_and_resumes_it(sample_root, image_dtype):
    data = DataConfig(format="lerobot", root=str(sample_root), num_workers=0, image_dtype=image_dtype)
    dataset = open_dataset(sample_root, {"action": [0.0, 0.1]})
    loader, sampler = build_dataloader(dataset, data, micro_batch_size=8, rank=1, world_size=2, seed=3)
    assert dataset.image_dtype == image_dtype
    # rank 1 of 2 draws positions 1, 3, 5, ... of the (seed, epoch) permutation
    want = epoch_permutation(np.arange(1, len(dataset), 2), num_samples=len(dataset), seed=3, epoch=0).tolist()
    batches = iter(loader)
    drawn = [next(batches) for _ in range(3)]
    assert torch.cat([b["index"] for b in drawn]).tolist() == want[:24]
    camera = drawn[0]["observation.images.top"]
    assert camera.dtype == getattr(torch, image_dtype) and camera.shape[1:] == (3, 48, 48)
    sampler.advance(16)  # two micro-batches consumed on each rank; a resumed run goes on from the third
    state = sampler.state_dict()
    resumed_loader, resumed = build_dataloader(open_dataset(sample_root, {"action": [0.0, 0.1]}), data,
                                               micro_batch_size=8, rank=1, world_size=2, seed=3)
    resumed.load_state_dict(state)
    assert next(iter(resumed_loader))["index"].tolist() == want[16:24]


def test_the_loader_counts_what_its_workers_decoded(sample_root):
    from embodyhpc.train.stream import loader_rates

    data = DataConfig(format="lerobot", root=str(sample_root), num_workers=0, image_dtype="uint8")
    loader, _ = build_dataloader(open_dataset(sample_root, {"action": [0.0]}), data, micro_batch_size=4, rank=0,
                                 world_size=1, seed=0)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    samples, decode_s, busy_s = loader.counters.take()
    assert samples == 12 and 0 < decode_s <= busy_s
    assert loader.counters.take() == (0, 0.0, 0.0)  # since the last take
    # the formula: ms per sample, and samples per busy second times the workers side by side
    assert loader_rates(12, 0.024, 0.06, num_workers=2) == {"data_decode_ms_per_sample": 2.0,
                                                            "data_loader_samples_per_s": 400.0}
    assert loader_rates(0, 0.0, 0.0, num_workers=2) == {}
