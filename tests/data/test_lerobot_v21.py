"""LeRobot v2.1: the reader gives what LeRobot 0.3.3's own reader gave for a folder LeRobot 0.3.3 wrote, and
`embodyhpc data convert` writes a v3.0 folder that reads the same.

The fixture (tests/data/fixtures/lerobot_v21_sample and lerobot_v21_expected.{npz,json}) was made by
tools/reference_fixtures/lerobot_v21.py with LeRobot's own writer and reader; nothing here produced it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from embodyhpc.data import DatasetError, LeRobotV3Dataset, LeRobotV21Dataset, detect_format, open_dataset
from embodyhpc.data.convert import convert_v21_to_v30
from embodyhpc.data.normalize import StateNormalizer
from embodyhpc.data.v21_meta import v21_stats
from embodyhpc.errors import UserError
from tests.data.conftest import FIXTURES, writable_copy
from tests.helpers import one_line_error

V21_ROOT = FIXTURES / "lerobot_v21_sample"
META = json.loads((FIXTURES / "lerobot_v21_expected.json").read_text())
with np.load(FIXTURES / "lerobot_v21_expected.npz") as _npz:
    EXPECTED = {k: _npz[k] for k in _npz.files}
CAMERA = "observation.images.cam"
META_FPS = int(EXPECTED["fps"])
MODES = list(META["delta_timestamps"])
# As tests/data/test_lerobot.py: decoders differ by a grey level or two; neighbouring frames by far more
# (test_image_tolerance_cannot_hide_a_wrong_frame).
IMAGE_ATOL = 2 / 255 + 1e-6


def assert_matches_lerobot(item: dict, mode: str, index: int) -> None:
    """Keys, dtypes, shapes and values as LeRobot 0.3.3 returned them: numbers exactly, frames within IMAGE_ATOL."""
    want = META["items"][f"{mode}/{index}"]
    assert sorted(item) == sorted(want), (mode, index)
    for key, spec in want.items():
        got = item[key]
        if "str" in spec:
            assert got == spec["str"], (mode, index, key)
            continue
        assert isinstance(got, torch.Tensor), (mode, index, key)
        assert (str(got.dtype), list(got.shape)) == (f"torch.{spec['dtype']}", spec["shape"]), (mode, index, key)
        value = torch.from_numpy(EXPECTED[f"{mode}/{index}/{key}"])
        if key == CAMERA:
            torch.testing.assert_close(got, value.float() / 255, atol=IMAGE_ATOL, rtol=0, msg=f"{mode} {index} {key}")
        else:
            assert torch.equal(got, value), (mode, index, key, got, value)


@pytest.fixture(scope="module", params=["torchcodec", "pyav"])
def readers(request) -> dict[str, LeRobotV21Dataset]:
    return {mode: open_dataset(V21_ROOT, META["delta_timestamps"][mode], video_backend=request.param)
            for mode in MODES}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "v30"
    convert_v21_to_v30(V21_ROOT, out)
    return out


@pytest.fixture
def v21_copy(tmp_path) -> Path:
    return writable_copy(V21_ROOT, tmp_path / "v21")


def test_format_length_and_tasks(readers):
    dataset = readers["plain"]
    assert detect_format(V21_ROOT) == "lerobot-v2.1"
    assert isinstance(dataset, LeRobotV21Dataset)
    assert (len(dataset), dataset.fps) == (int(EXPECTED["len"]), int(EXPECTED["fps"]))
    assert dataset.num_episodes == len(META["episode_lengths"])
    assert sorted(dataset.tasks.values()) == sorted(META["tasks"])


@pytest.mark.parametrize("mode", MODES)
def test_items_match_lerobot(readers, mode):
    for index in META["indices"]:
        assert_matches_lerobot(readers[mode][index], mode, index)


def test_pads_repeat_the_episode_edges(readers):
    """Episode 1 spans rows 12..18: history before its first frame and a chunk after its last are padded with them."""
    first, last = readers["delta"][12], readers["delta"][18]
    assert first[f"{CAMERA}_is_pad"].tolist() == [True, True, False]
    assert torch.equal(first[CAMERA][0], first[CAMERA][2]) and torch.equal(first[CAMERA][1], first[CAMERA][2])
    assert first["observation.state_is_pad"].tolist() == [True, False]
    assert last["action_is_pad"].tolist() == [False, True, True, True]
    assert torch.equal(last["action"], last["action"][:1].expand(4, -1))


def test_image_tolerance_cannot_hide_a_wrong_frame():
    frames = torch.from_numpy(EXPECTED["delta/5/" + CAMERA]).float() / 255  # frames 3, 4, 5 of episode 0
    for earlier, later in zip(frames[:-1], frames[1:], strict=True):
        assert (earlier - later).abs().max() > 20 * IMAGE_ATOL


def test_statistics_are_lerobots_aggregate():
    stats = v21_stats(V21_ROOT)
    recorded = {k.split("/")[1] for k in EXPECTED if k.startswith("stats/")}
    assert set(stats) == recorded
    for feature, entry in stats.items():
        for stat, value in entry.items():
            np.testing.assert_allclose(value, EXPECTED[f"stats/{feature}/{stat}"], rtol=1e-12, err_msg=feature)
    norm = StateNormalizer.from_dataset(V21_ROOT, "observation.state", "mean_std")
    np.testing.assert_allclose(norm.offset, EXPECTED["stats/observation.state/mean"], rtol=1e-12)
    np.testing.assert_allclose(norm.scale, EXPECTED["stats/observation.state/std"], rtol=1e-12)
    with pytest.raises(UserError, match="needs q01 and q99 of 'observation.state'.*data convert") as raised:
        StateNormalizer.from_dataset(V21_ROOT, "observation.state", "quantile")
    assert "\n" not in str(raised.value)


# -- conversion to v3.0 ----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_converted_reads_as_lerobot_and_the_source(converted, readers, mode):
    dataset = open_dataset(converted, META["delta_timestamps"][mode], video_backend=readers[mode].decoder.backend)
    assert isinstance(dataset, LeRobotV3Dataset) and not isinstance(dataset, LeRobotV21Dataset)
    assert len(dataset) == len(readers[mode])
    for index in range(len(dataset)):
        item, source = dataset[index], readers[mode][index]
        if index in META["indices"]:
            assert_matches_lerobot(item, mode, index)
        assert sorted(item) == sorted(source)
        for key, value in source.items():  # frames too: the packets were copied, not re-encoded
            assert item[key] == value if key == "task" else torch.equal(item[key], value), (index, key)


def test_converted_layout_and_statistics(converted):
    info = json.loads((converted / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and (info["total_episodes"], info["total_frames"]) == (3, 28)
    assert [p.relative_to(converted).as_posix() for p in sorted(converted.rglob("*.mp4"))] == [
        f"videos/{CAMERA}/chunk-000/file-000.mp4"]
    episodes = pq.read_table(converted / "meta" / "episodes" / "chunk-000" / "file-000.parquet").to_pydict()
    lengths = META["episode_lengths"]
    starts = np.cumsum([0, *lengths[:-1]])
    assert episodes["dataset_from_index"] == starts.tolist()
    # Each episode's video starts where the previous one ends in the joined file: its first frame / fps.
    np.testing.assert_allclose(episodes[f"videos/{CAMERA}/from_timestamp"], starts / META_FPS, rtol=0, atol=1e-9)
    stats = json.loads((converted / "meta" / "stats.json").read_text())
    for stat in ("min", "max", "mean", "std", "count"):  # computed over every frame: LeRobot's aggregate
        np.testing.assert_allclose(stats["observation.state"][stat], EXPECTED[f"stats/observation.state/{stat}"],
                                   rtol=1e-6)
        np.testing.assert_allclose(stats[CAMERA][stat], EXPECTED[f"stats/{CAMERA}/{stat}"], rtol=1e-12)
    states = np.concatenate([np.stack(pq.read_table(p, columns=["observation.state"]).column(0).to_pylist())
                             for p in sorted((V21_ROOT / "data").rglob("*.parquet"))])
    np.testing.assert_allclose(stats["observation.state"]["q01"], np.quantile(states, 0.01, axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats["observation.state"]["q99"], np.quantile(states, 0.99, axis=0), rtol=1e-12)


def test_cli_convert_and_its_refusals(cli, tmp_path, converted):
    out = tmp_path / "new" / "v30"
    result = cli("data", "convert", str(V21_ROOT), "--to", "v3.0", "--out", str(out))
    assert result.code == 0 and result.out.startswith("wrote 3 episodes (28 frames, 1 video files"), result
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    one_line_error(cli("data", "convert", str(V21_ROOT), "--out", str(out)), "--out", "not empty")
    one_line_error(cli("data", "convert", str(converted), "--out", str(tmp_path / "b")), "SRC", "'v3.0', not 'v2.1'")
    one_line_error(cli("data", "convert", str(V21_ROOT), "--to", "v2.0", "--out", str(tmp_path / "c")), "--to")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


def test_cli_convert_of_a_broken_source_writes_nothing(cli, tmp_path, v21_copy):
    (v21_copy / "meta" / "episodes.jsonl").rename(tmp_path / "episodes.jsonl")
    one_line_error(cli("data", "convert", str(v21_copy), "--out", str(tmp_path / "d" / "e")), "episodes.jsonl")
    assert not (tmp_path / "d").exists()
    # found only while writing (episode 1's video): what was written is removed, the parents made too
    (tmp_path / "episodes.jsonl").rename(v21_copy / "meta" / "episodes.jsonl")
    video = v21_copy / "videos" / "chunk-000" / CAMERA / "episode_000001.mp4"
    video.write_bytes(video.read_bytes()[:200])
    one_line_error(cli("data", "convert", str(v21_copy), "--out", str(tmp_path / "d" / "e")), str(video),
                   "cannot read the video")
    assert not (tmp_path / "d").exists()


# -- hostile folders: one line naming the file ------------------------------------------------------------

def _edit_info(root: Path, **changes) -> None:
    path = root / "meta" / "info.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _edit_episodes(root: Path, edit) -> None:
    path = root / "meta" / "episodes.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in edit(rows)))


def _drop_episode_1(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["episode_index"] != 1]


def _lengthen_episode_1(rows: list[dict]) -> list[dict]:
    return [{**r, "length": r["length"] + 1} if r["episode_index"] == 1 else r for r in rows]


HOSTILE = {
    "missing episodes.jsonl": (lambda root: (root / "meta" / "episodes.jsonl").unlink(),
                               "meta/episodes.jsonl: file missing"),
    "data path outside": (lambda root: _edit_info(root, data_path="../elsewhere/episode_{episode_index:06d}.parquet"),
                          "outside the dataset folder"),
    "codebase v2.0": (lambda root: _edit_info(root, codebase_version="v2.0"),
                      "'v2.0'.*convert_dataset_v20_to_v21.*embodyhpc data convert"),
    "codebase v9": (lambda root: _edit_info(root, codebase_version="v9"), "'v9'; only 'v3.0' and 'v2.1' are read"),
    "episode index gap": (lambda root: _edit_episodes(root, _drop_episode_1), "episode 1 is missing"),
    "length vs rows": (lambda root: _edit_episodes(root, _lengthen_episode_1),
                       "episode_000001.parquet: holds 7 frames; meta/episodes.jsonl gives episode 1 length 8"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_folder_is_one_line(v21_copy, case):
    break_it, match = HOSTILE[case]
    break_it(v21_copy)
    with pytest.raises(DatasetError, match=match) as raised:
        open_dataset(v21_copy, video_backend="pyav")
    assert "\n" not in str(raised.value) and str(v21_copy) in str(raised.value)


def test_hdf5_camera_with_one_offset_is_squeezed_as_lerobot(tmp_path):
    """LeRobot returns one camera frame asked through delta_timestamps without its time axis (the "single" mode
    above); the HDF5 reader, which promises LeRobot's item shapes, must too (a chunk of actions keeps its axis)."""
    import h5py

    assert len(META["items"]["single/5"][CAMERA]["shape"]) == 3 and META["items"]["single/5"]["action"]["shape"][0] == 1
    path = tmp_path / "demos.hdf5"
    with h5py.File(path, "w") as f:
        demo = f.create_group("data").create_group("demo_0")
        demo.create_dataset("obs/agentview_rgb", data=np.arange(4 * 4 * 2 * 3, dtype=np.uint8).reshape(4, 4, 2, 3))
        demo.create_dataset("actions", data=np.zeros((4, 2)))
    item = open_dataset(path, {"observation.images.agentview_rgb": [-0.05], "action": [0.0]})[1]
    assert item["observation.images.agentview_rgb"].shape == (3, 4, 2) and item["action"].shape == (1, 2)
    assert item["observation.images.agentview_rgb_is_pad"].tolist() == [False]
