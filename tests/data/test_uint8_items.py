"""data.image_dtype=uint8: items whose cameras are the decoded bytes, uint8 (C, H, W), and everything else as the
float items have it. References: the float items (LeRobot 0.4.4's values, tests/data/test_lerobot.py) times 255,
exactly; LeRobot's recorded items themselves (sample_expected.npz) to its image tolerance; the HDF5 file's own bytes.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from embodyhpc.data import open_dataset
from tests.data.conftest import FIXTURES
from tests.data.test_lerobot import IMAGE_ATOL, INDICES, expected_item

V21_ROOT = FIXTURES / "lerobot_v21_sample"
# past the episode edges at both ends (pads), a history frame, a chunk; episode 2 spans rows 60..89 of the v3.0 sample
EDGE_INDICES = [0, 1, 29, 30, 59, 60, 61, 88, 89, 119]


def _is_camera(key: str) -> bool:
    return key.startswith("observation.images.") and not key.endswith("_is_pad")


def assert_uint8_is_float_times_255(float_item: dict, uint8_item: dict) -> None:
    assert sorted(uint8_item) == sorted(float_item)
    for key, want in float_item.items():
        got = uint8_item[key]
        if not isinstance(want, torch.Tensor):
            assert got == want, key
        elif _is_camera(key):
            assert want.dtype == torch.float32 and got.dtype == torch.uint8, key
            assert got.shape == want.shape, key
            assert torch.equal(want * 255, got.to(torch.float32)), key  # exact: the same frame, not a neighbour
            assert torch.equal(got.to(torch.float32).div_(255), want), key
        else:  # timestamps, pads, actions, indices: untouched
            assert got.dtype == want.dtype and torch.equal(got, want), key


@pytest.mark.parametrize("backend", ["torchcodec", "pyav"])
def test_lerobot_v30_uint8_items_are_the_float_items_times_255(sample_root, expected_delta_timestamps, backend):
    float_set = open_dataset(sample_root, expected_delta_timestamps, video_backend=backend)
    uint8_set = open_dataset(sample_root, expected_delta_timestamps, video_backend=backend, image_dtype="uint8")
    assert float_set.image_dtype == "float32"  # the default stays LeRobot's items
    for index in EDGE_INDICES:
        assert_uint8_is_float_times_255(float_set[index], uint8_set[index])


def test_uint8_items_match_lerobots_recorded_items(sample_root, expected_delta_timestamps, expected):
    """Against LeRobot 0.4.4's own items (recorded): same keys, shapes, pads and timestamps; images within LeRobot's
    decoder tolerance once divided by 255."""
    uint8_set = open_dataset(sample_root, expected_delta_timestamps, image_dtype="uint8")
    for index in INDICES["delta"]:
        want = expected_item(expected, "delta", index)
        got = uint8_set[index]
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            if key == "task":
                assert got[key] == str(value)
            elif _is_camera(key):
                assert got[key].dtype == torch.uint8 and tuple(got[key].shape) == value.shape
                torch.testing.assert_close(got[key].float() / 255, torch.from_numpy(value), atol=IMAGE_ATOL, rtol=0)
            else:
                assert torch.equal(got[key], torch.from_numpy(value)), key


def test_lerobot_v21_uint8_items_are_the_float_items_times_255():
    delta = {"observation.images.cam": [-0.1, 0.0], "action": [0.0, 0.1, 0.2]}
    float_set = open_dataset(V21_ROOT, delta)
    uint8_set = open_dataset(V21_ROOT, delta, image_dtype="uint8")
    for index in (0, 1, len(float_set) // 2, len(float_set) - 1):
        assert_uint8_is_float_times_255(float_set[index], uint8_set[index])


def test_hdf5_uint8_items_are_the_stored_bytes(tmp_path):
    path = tmp_path / "demos.hdf5"
    image = np.random.default_rng(0).integers(0, 256, (5, 4, 6, 3), dtype=np.uint8)
    with h5py.File(path, "w") as f:
        f.create_dataset("data/demo_0/obs/agentview_rgb", data=image)
        f.create_dataset("data/demo_0/actions", data=np.zeros((5, 2)))
    delta = {"observation.images.agentview_rgb": [-0.05, 0.0]}
    float_set, uint8_set = open_dataset(path, delta), open_dataset(path, delta, image_dtype="uint8")
    for index in range(5):
        assert_uint8_is_float_times_255(float_set[index], uint8_set[index])
        rows = [max(index - 1, 0), index]  # the history frame clamps to the first step
        want = torch.from_numpy(image[rows]).permute(0, 3, 1, 2)
        assert torch.equal(uint8_set[index]["observation.images.agentview_rgb"], want)


def test_an_unknown_image_dtype_names_the_choices(sample_root):
    with pytest.raises(ValueError, match="image_dtype must be one of float32, uint8, got 'float16'"):
        open_dataset(sample_root, image_dtype="float16")
