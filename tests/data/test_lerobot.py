"""LeRobot v3.0 reader: items equal what LeRobot 0.4.4 returns for the same folder (plain and delta)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset

from embodyhpc.data import DatasetError, LeRobotV3Dataset, detect_format, open_dataset
from embodyhpc.data.errors import SampleError
from tests.data.conftest import FIXTURES

# Decoders differ in YUV->RGB rounding (Debian's FFmpeg for torchcodec, PyAV's bundled FFmpeg, whatever
# LeRobot ran with) by a grey level or two; 1e-6 absorbs float32 rounding of k/255. Neighbouring frames of
# this sample differ by far more (test_image_tolerance_cannot_hide_a_wrong_frame), so this tolerance never
# accepts an off-by-one frame.
IMAGE_ATOL = 2 / 255 + 1e-6
NUMERIC_ATOL = 1e-6

with np.load(FIXTURES / "sample_expected.npz") as _npz:
    INDICES = {mode: [int(i) for i in _npz[f"{mode}/indices"]] for mode in ("plain", "delta")}


def expected_item(expected: dict[str, np.ndarray], mode: str, index: int) -> dict[str, np.ndarray]:
    prefix = f"{mode}/{index}/"
    return {k[len(prefix):]: v for k, v in expected.items() if k.startswith(prefix)}


def assert_item_matches(item: dict, want: dict[str, np.ndarray]) -> None:
    assert sorted(item) == sorted(want)
    for key, want_value in want.items():
        got = item[key]
        if key == "task":
            assert isinstance(got, str) and got == str(want_value)
            continue
        assert isinstance(got, torch.Tensor), key
        assert tuple(got.shape) == want_value.shape, key
        assert got.dtype == torch.from_numpy(want_value).dtype, key
        if got.dtype.is_floating_point:
            atol = IMAGE_ATOL if key.startswith("observation.images.") and not key.endswith("_is_pad") else NUMERIC_ATOL
            torch.testing.assert_close(got, torch.from_numpy(want_value), atol=atol, rtol=0, msg=key)
        else:
            assert torch.equal(got, torch.from_numpy(want_value)), key


@pytest.fixture(scope="module", params=["torchcodec", "pyav"])
def backend(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def plain_dataset(sample_root, backend) -> LeRobotV3Dataset:
    return open_dataset(sample_root, video_backend=backend)


@pytest.fixture(scope="module")
def delta_dataset(sample_root, expected_delta_timestamps, backend) -> LeRobotV3Dataset:
    return open_dataset(sample_root, expected_delta_timestamps, video_backend=backend)


def test_len_fps_and_format(plain_dataset, expected, sample_root):
    assert detect_format(sample_root) == "lerobot-v3.0"
    assert isinstance(plain_dataset, LeRobotV3Dataset)
    assert len(plain_dataset) == int(expected["len"])
    assert plain_dataset.fps == int(expected["fps"])
    assert plain_dataset.num_episodes == 4
    assert plain_dataset.video_keys == ["observation.images.top", "observation.images.wrist"]
    assert plain_dataset.tasks == {0: "push the block", 1: "open the drawer"}


@pytest.mark.parametrize("index", INDICES["plain"])
def test_plain_item_matches_lerobot(plain_dataset, expected, index):
    assert_item_matches(plain_dataset[index], expected_item(expected, "plain", index))


@pytest.mark.parametrize("index", INDICES["delta"])
def test_delta_item_matches_lerobot(delta_dataset, expected, index):
    assert_item_matches(delta_dataset[index], expected_item(expected, "delta", index))


def test_delta_pads_clamp_to_episode_edges(delta_dataset):
    first, last = delta_dataset[60], delta_dataset[89]  # episode 2 spans rows 60..89
    assert first["observation.images.wrist_is_pad"].tolist() == [True, True, False]
    # Padded history repeats the episode's first frame; a padded action chunk repeats its last action.
    assert torch.equal(first["observation.images.wrist"][0], first["observation.images.wrist"][2])
    assert last["action_is_pad"].tolist() == [False] + [True] * 9
    assert torch.equal(last["action"], last["action"][:1].expand(10, -1))


def test_negative_index_and_out_of_range(plain_dataset):
    assert int(plain_dataset[-1]["index"]) == len(plain_dataset) - 1
    with pytest.raises(IndexError):
        plain_dataset[len(plain_dataset)]


def test_image_tolerance_cannot_hide_a_wrong_frame(expected):
    # A 3-frame wrist history well inside an episode: consecutive frames must differ beyond the tolerance.
    index = next(i for i in INDICES["delta"] if not expected[f"delta/{i}/observation.images.wrist_is_pad"].any())
    frames = torch.from_numpy(expected[f"delta/{index}/observation.images.wrist"])
    for earlier, later in zip(frames[:-1], frames[1:], strict=True):
        assert (earlier - later).abs().max() > 20 * IMAGE_ATOL


def _check_fresh_worker(worker_id: int) -> None:
    info = torch.utils.data.get_worker_info()
    # The parent decoded before forking; the child must not reuse (or even count) those decoders.
    assert info.dataset.dataset.decoder.num_open == 0


def test_dataloader_fork_workers_open_their_own_decoders(sample_root, expected_delta_timestamps):
    dataset = open_dataset(sample_root, expected_delta_timestamps, video_backend="torchcodec")
    indices = [0, 1, 29, 30, 31, 58, 59, 60, 89, 90, 118, 119]
    want = [dataset[i] for i in indices]  # opens decoders in the parent before the fork, on purpose
    assert dataset.decoder.num_open == 2
    loader = DataLoader(Subset(dataset, indices), batch_size=3, num_workers=2, persistent_workers=True,
                        multiprocessing_context="fork", worker_init_fn=_check_fresh_worker)
    for _epoch in range(2):  # the second epoch reuses the persistent workers and their cached decoders
        batches = list(loader)
        got_indices = torch.cat([b["index"] for b in batches]).tolist()
        assert got_indices == indices
        for key in want[0]:
            got = [x for b in batches for x in (b[key] if key == "task" else b[key].unbind(0))]
            for g, w in zip(got, (w[key] for w in want), strict=True):
                assert g == w if key == "task" else torch.equal(g, w), key


# -- errors a user can act on -------------------------------------------------------------------------

def test_missing_path_names_it(tmp_path):
    with pytest.raises(DatasetError, match="does not exist") as info:
        open_dataset(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(info.value)


def test_folder_without_info_json_says_what_was_expected(tmp_path):
    with pytest.raises(DatasetError, match="meta/info.json") as info:
        open_dataset(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_older_codebase_version_is_refused(sample_copy):
    info_path = sample_copy / "meta" / "info.json"
    info = json.loads(info_path.read_text())
    info["codebase_version"] = "v2.0"  # v2.1 is read (tests/data/test_lerobot_v21.py)
    info_path.write_text(json.dumps(info))
    with pytest.raises(DatasetError, match=r"'v2.0'.*'v3.0'") as exc:
        open_dataset(sample_copy)
    assert str(info_path) in str(exc.value)


def test_non_hdf5_file_is_refused(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("a,b\n")
    with pytest.raises(DatasetError, match="not HDF5"):
        open_dataset(path)


@pytest.mark.parametrize(("delta", "match"), [
    ({"observation.velocity": [0.0]}, "unknown feature 'observation.velocity'"),
    ({"action": [0.0, 0.05]}, "not multiples of 1/fps"),
    ({"action": []}, "non-empty"),
])
def test_bad_delta_timestamps(sample_root, delta, match):
    with pytest.raises(DatasetError, match=match):
        open_dataset(sample_root, delta, video_backend="pyav")


def test_missing_video_file_is_reported(sample_copy):
    video = sample_copy / "videos" / "observation.images.top" / "chunk-000" / "file-000.mp4"
    video.unlink()
    dataset = open_dataset(sample_copy, video_backend="pyav")
    with pytest.raises(SampleError, match="video file not found") as raised:  # a bad sample: the file and episode
        dataset[0]
    assert str(raised.value).startswith(f"{video}: episode 0, frame 0 (index 0): cannot decode observation.images.top")
