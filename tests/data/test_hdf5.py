"""HDF5 reader (robomimic/LIBERO layout) on a file the test writes: values, delta pads, fork workers."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from embodyhpc.data import DatasetError, HDF5EpisodeDataset, detect_format, open_dataset
from tests.helpers import require

h5py = require("h5py", "data")

LENGTHS = {"demo_0": 5, "demo_2": 4, "demo_10": 7}  # demo_10 sorts after demo_2


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """(path, {demo: {"image", "eef_pos", "actions"}}) for a LIBERO-like file with a language instruction."""
    path = tmp_path_factory.mktemp("hdf5") / "demos.hdf5"
    rng = np.random.default_rng(0)
    written = {}
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["problem_info"] = json.dumps({"language_instruction": "put the bowl on the plate"})
        for name, length in LENGTHS.items():
            demo = data.create_group(name)
            written[name] = {"image": rng.integers(0, 256, (length, 8, 6, 3), dtype=np.uint8),
                             "eef_pos": rng.standard_normal((length, 3)),  # float64, as robomimic writes
                             "actions": rng.standard_normal((length, 2))}
            demo.create_dataset("obs/agentview_rgb", data=written[name]["image"])
            demo.create_dataset("obs/ee_pos", data=written[name]["eef_pos"])
            demo.create_dataset("actions", data=written[name]["actions"])
        f.create_group("mask")  # robomimic's split lists: ignored
    return path, written


def test_plain_items(demos):
    path, written = demos
    assert detect_format(path) == "hdf5"
    dataset = open_dataset(path)
    assert isinstance(dataset, HDF5EpisodeDataset)
    assert len(dataset) == sum(LENGTHS.values()) and dataset.num_episodes == 3
    assert dataset.demos == ["demo_0", "demo_2", "demo_10"]
    item = dataset[5 + 4 + 3]  # demo_10, step 3
    want = written["demo_10"]
    assert set(item) == {"observation.images.agentview_rgb", "observation.ee_pos", "action", "timestamp",
                         "frame_index", "episode_index", "index", "task_index", "task"}
    image = item["observation.images.agentview_rgb"]
    assert image.dtype == torch.float32 and image.shape == (3, 8, 6)
    assert torch.equal(image, torch.from_numpy(want["image"][3]).permute(2, 0, 1).float() / 255)
    torch.testing.assert_close(item["observation.ee_pos"], torch.from_numpy(want["eef_pos"][3]).float())
    torch.testing.assert_close(item["action"], torch.from_numpy(want["actions"][3]).float())
    assert item["action"].dtype == torch.float32
    assert item["timestamp"].dtype == torch.float32 and item["timestamp"].shape == ()
    assert item["timestamp"].item() == pytest.approx(3 / 20)
    assert [int(item[k]) for k in ("frame_index", "episode_index", "index", "task_index")] == [3, 2, 12, 0]
    assert item["task"] == "put the bowl on the plate"


def test_delta_items_pad_at_episode_edges(demos):
    path, written = demos
    dataset = open_dataset(path, {"action": [0.0, 0.05, 0.1], "observation.images.agentview_rgb": [-0.05, 0.0],
                                  "frame_index": [-0.05, 0.0]})
    item = dataset[5 + 3]  # last step of demo_2
    assert item["action_is_pad"].tolist() == [False, True, True]
    torch.testing.assert_close(item["action"], torch.from_numpy(written["demo_2"]["actions"][[3, 3, 3]]).float())
    assert item["observation.images.agentview_rgb"].shape == (2, 3, 8, 6)
    assert item["observation.images.agentview_rgb_is_pad"].tolist() == [False, False]
    assert item["frame_index"].tolist() == [2, 3]
    first = dataset[5]  # first step of demo_2
    assert first["observation.images.agentview_rgb_is_pad"].tolist() == [True, False]
    assert torch.equal(first["observation.images.agentview_rgb"][0], first["observation.images.agentview_rgb"][1])


def test_fork_workers_reopen_the_file(demos):
    path, _ = demos
    dataset = open_dataset(path, {"action": [0.0, 0.05]})
    want = [dataset[i] for i in range(len(dataset))]  # opens the file in the parent first
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
    got = [a for batch in loader for a in batch["action"].unbind(0)]
    assert all(torch.equal(g, w["action"]) for g, w in zip(got, want, strict=True))


def test_not_robomimic_layout(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("images", data=np.zeros((2, 2)))
    with pytest.raises(DatasetError, match="no 'data' group"):
        open_dataset(path)
