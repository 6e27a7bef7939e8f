"""LeRobot v3.0 writer: what it writes reads back through our reader with the values written, in LeRobot's layout."""

from __future__ import annotations

import json

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from embodyhpc.data import DatasetError, detect_format, open_dataset
from embodyhpc.data.video_encode import VideoOptions
from embodyhpc.data.writer import LeRobotWriter
from tests.data.conftest import SAMPLE_ROOT

FPS = 10
NUM_FRAMES = 15
SIZE = 32
CAMERAS = ("observation.images.top", "observation.images.wrist")
TASKS = ("push the block", "open the drawer")
FEATURES = {
    CAMERAS[0]: {"dtype": "video", "shape": [SIZE, SIZE, 3]},
    CAMERAS[1]: {"dtype": "video", "shape": [SIZE, SIZE, 3]},
    "observation.state": {"dtype": "float32", "shape": [4], "names": ["x", "y", "z", "grip"]},
    "action": {"dtype": "float32", "shape": [4], "names": ["dx", "dy", "dz", "grip"]},
}
# Lossy video (h264 CRF 18 or AV1 CRF 30, yuv420p) on these 32x32 gradients: measured at most 9 (h264) and 8 (AV1)
# grey levels off, mean under 1.9. Neighbouring frames differ by >= 6 levels per channel everywhere, and each
# decoded frame must also be closer to its own frame than to any other frame of its episode, so these bounds
# never accept a wrong frame.
IMAGE_MAX_ATOL = 20 / 255
IMAGE_MEAN_ATOL = 3 / 255


def make_frames(num_frames: int, offset: int) -> np.ndarray:
    """Smooth uint8 RGB frames (T, H, W, 3) that change by >= 6 levels per channel from frame to frame."""
    y, x = np.mgrid[0:SIZE, 0:SIZE] / (SIZE - 1)
    t = np.arange(num_frames)[:, None, None]
    rgb = np.stack([30 + 80 * x + 10 * t, 30 + 60 * y + 25 * offset + 6 * t, 200 - 80 * x * y - 6 * t], axis=-1)
    assert rgb.min() >= 0 and rgb.max() <= 255  # no uint8 wrap-around
    return np.round(rgb).astype(np.uint8)


def make_episodes(num_episodes: int = 2, num_frames: int = NUM_FRAMES) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{CAMERAS[0]: make_frames(num_frames, 2 * e), CAMERAS[1]: make_frames(num_frames, 2 * e + 1),
             "observation.state": rng.normal(size=(num_frames, 4)).astype(np.float32),
             "action": rng.normal(size=(num_frames, 4)).astype(np.float32)} for e in range(num_episodes)]


def write(root, episodes, **options) -> None:
    with LeRobotWriter(root, fps=FPS, features=FEATURES, robot_type="sawyer", **options) as writer:
        for e, episode in enumerate(episodes):
            assert writer.add_episode(episode, task=TASKS[e % len(TASKS)], extra={"success": e % 2 == 0}) == e


def assert_frame_close(got: torch.Tensor, frames: np.ndarray, frame_index: int, what: str) -> None:
    """got: float32 (3, H, W) in [0, 1]; frames: the episode's uint8 (T, H, W, 3) as written."""
    want = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 255
    assert got.dtype == torch.float32 and tuple(got.shape) == (3, SIZE, SIZE), what
    error = (got - want[frame_index]).abs()
    assert error.max() <= IMAGE_MAX_ATOL and error.mean() <= IMAGE_MEAN_ATOL, (what, error.max() * 255)
    assert int((got[None] - want).abs().mean(dim=(1, 2, 3)).argmin()) == frame_index, f"{what}: another frame"


@pytest.fixture(scope="module")
def episodes() -> list[dict[str, np.ndarray]]:
    return make_episodes()


@pytest.fixture(scope="module")
def written(tmp_path_factory, episodes):
    root = tmp_path_factory.mktemp("written") / "dataset"
    write(root, episodes)
    return root


@pytest.mark.parametrize("backend", ["torchcodec", "pyav"])
def test_round_trip(written, episodes, backend):
    dataset = open_dataset(written, video_backend=backend)
    assert len(dataset) == 2 * NUM_FRAMES and dataset.num_episodes == 2 and dataset.fps == FPS
    assert dataset.tasks == dict(enumerate(TASKS))
    for index in range(len(dataset)):
        item = dataset[index]
        episode_index, frame_index = divmod(index, NUM_FRAMES)
        episode = episodes[episode_index]
        assert sorted(item) == sorted([*FEATURES, "timestamp", "frame_index", "episode_index", "index",
                                       "task_index", "task"])
        for key in ("observation.state", "action"):
            assert torch.equal(item[key], torch.from_numpy(episode[key][frame_index])), key
        assert item["timestamp"].dtype == torch.float32 and item["timestamp"].shape == ()
        assert item["timestamp"] == torch.tensor(frame_index / FPS, dtype=torch.float32)
        for key, want in (("frame_index", frame_index), ("episode_index", episode_index), ("index", index),
                          ("task_index", episode_index)):
            assert item[key].dtype == torch.int64 and item[key].shape == () and int(item[key]) == want, key
        assert item["task"] == TASKS[episode_index]
        for camera in CAMERAS:
            assert_frame_close(item[camera], episode[camera], frame_index, f"{camera} item {index}")


def test_round_trip_with_delta_timestamps(written, episodes):
    history = [-0.2, -0.1, 0.0]
    chunk = [i / FPS for i in range(5)]
    dataset = open_dataset(written, {"observation.state": history, CAMERAS[0]: [-0.1, 0.0], "action": chunk})
    steps = {"observation.state": [-2, -1, 0], CAMERAS[0]: [-1, 0], "action": [0, 1, 2, 3, 4]}
    for index in range(len(dataset)):
        item = dataset[index]
        episode_index, frame_index = divmod(index, NUM_FRAMES)
        for key, offsets in steps.items():
            wanted = np.asarray(offsets) + frame_index
            rows = np.clip(wanted, 0, NUM_FRAMES - 1)  # LeRobot repeats the episode's edge frame
            is_pad = (wanted < 0) | (wanted >= NUM_FRAMES)
            assert torch.equal(item[f"{key}_is_pad"], torch.from_numpy(is_pad)), (key, index)
            if key == CAMERAS[0]:
                assert item[key].shape == (len(offsets), 3, SIZE, SIZE)
                for t, row in enumerate(rows):
                    assert_frame_close(item[key][t], episodes[episode_index][key], int(row), f"{key} {index}/{t}")
            else:
                assert torch.equal(item[key], torch.from_numpy(episodes[episode_index][key][rows])), (key, index)
    # the edges themselves: first frame of episode 1 pads its history, last frame of episode 0 its chunk
    assert dataset[NUM_FRAMES]["observation.state_is_pad"].tolist() == [True, True, False]
    assert dataset[NUM_FRAMES - 1]["action_is_pad"].tolist() == [False, True, True, True, True]
    assert dataset[NUM_FRAMES - 3]["action_is_pad"].tolist() == [False, False, False, True, True]


def test_metadata_matches_lerobot_layout(written, episodes):
    info = json.loads((written / "meta" / "info.json").read_text())
    sample_info = json.loads((SAMPLE_ROOT / "meta" / "info.json").read_text())
    assert detect_format(written) == "lerobot-v3.0"
    assert info["total_episodes"] == 2 and info["total_frames"] == 2 * NUM_FRAMES and info["total_tasks"] == 2
    assert info["splits"] == {"train": "0:2"} and info["fps"] == FPS
    for key in ("codebase_version", "data_path", "video_path", "chunks_size"):
        assert info[key] == sample_info[key], key
    assert list(info["features"]) == [*FEATURES, "timestamp", "frame_index", "episode_index", "index", "task_index"]
    camera = info["features"][CAMERAS[0]]
    assert camera["shape"] == [SIZE, SIZE, 3] and camera["names"] == ["height", "width", "channels"]
    assert camera["info"].keys() == sample_info["features"]["observation.images.top"]["info"].keys()
    assert camera["info"]["video.codec"] == "h264"
    for key in ("timestamp", "frame_index", "index"):
        assert info["features"][key] == sample_info["features"][key]

    # the same columns (and types) LeRobot writes, less its per-episode stats/*, plus our extra column
    episodes_table = pq.read_table(written / "meta/episodes/chunk-000/file-000.parquet")
    sample_schema = pq.read_schema(SAMPLE_ROOT / "meta/episodes/chunk-000/file-000.parquet")
    lerobot_columns = [n for n in sample_schema.names if not n.startswith("stats/")]
    assert episodes_table.column_names == [*lerobot_columns, "success"]
    for name in lerobot_columns:
        assert episodes_table.schema.field(name).type == sample_schema.field(name).type, name
    rows = episodes_table.to_pylist()
    assert [r["tasks"] for r in rows] == [[TASKS[0]], [TASKS[1]]]
    assert [r["success"] for r in rows] == [True, False]
    assert [(r["dataset_from_index"], r["dataset_to_index"], r["length"]) for r in rows] == [(0, 15, 15), (15, 30, 15)]
    assert [r[f"videos/{CAMERAS[1]}/from_timestamp"] for r in rows] == [0.0, 1.5]
    assert [r[f"videos/{CAMERAS[1]}/to_timestamp"] for r in rows] == [1.5, 3.0]

    data_schema = pq.read_schema(written / "data/chunk-000/file-000.parquet")
    sample_data_schema = pq.read_schema(SAMPLE_ROOT / "data/chunk-000/file-000.parquet")
    for name in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        assert data_schema.field(name).type == sample_data_schema.field(name).type, name
    assert data_schema.field("action").type == sample_data_schema.field("action").type
    assert json.loads(data_schema.metadata[b"huggingface"])["info"]["features"]["action"]["length"] == 4

    tasks = pq.read_table(written / "meta/tasks.parquet")
    assert tasks.schema.names == pq.read_schema(SAMPLE_ROOT / "meta/tasks.parquet").names
    assert json.loads(tasks.schema.metadata[b"pandas"])["index_columns"] == ["__index_level_0__"]


def test_stats(written, episodes):
    stats = json.loads((written / "meta" / "stats.json").read_text())
    assert set(stats) == set(json.loads((SAMPLE_ROOT / "meta" / "stats.json").read_text()))
    state = np.concatenate([e["observation.state"] for e in episodes]).astype(np.float64)
    np.testing.assert_allclose(stats["observation.state"]["mean"], state.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats["observation.state"]["std"], state.std(axis=0), rtol=1e-12)
    np.testing.assert_allclose(stats["observation.state"]["q50"], np.quantile(state, 0.5, axis=0), rtol=1e-12)
    assert stats["observation.state"]["min"] == state.min(axis=0).tolist()
    assert stats["index"]["min"] == [0] and stats["index"]["max"] == [29] and stats["index"]["count"] == [30]
    pixels = np.concatenate([e[CAMERAS[0]] for e in episodes]).reshape(-1, 3) / 255
    camera = stats[CAMERAS[0]]
    assert np.asarray(camera["mean"]).shape == (3, 1, 1) and camera["count"] == [30]
    np.testing.assert_allclose(np.asarray(camera["mean"]).reshape(3), pixels.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(np.asarray(camera["std"]).reshape(3), pixels.std(axis=0), rtol=1e-9)
    np.testing.assert_allclose(np.asarray(camera["max"]).reshape(3), pixels.max(axis=0))
    assert set(camera) == {"min", "max", "mean", "std", "count", "q01", "q10", "q50", "q90", "q99"}


def test_videos_have_short_gops(written):
    with av.open(str(written / "videos" / CAMERAS[0] / "chunk-000" / "file-000.mp4")) as container:
        stream = container.streams.video[0]
        keyframes = [p.is_keyframe for p in container.demux(stream) if p.size]
        assert stream.codec_context.name == "h264" and stream.average_rate == FPS
    assert len(keyframes) == 2 * NUM_FRAMES
    assert all(keyframes[::2]), "a keyframe every 2 frames"


def test_files_roll_over_and_read_back(tmp_path):
    episodes = make_episodes(num_episodes=3, num_frames=7)
    root = tmp_path / "rolled"
    write(root, episodes, data_file_size_mb=1e-9, video_file_size_mb=1e-9, chunks_size=2)
    assert sorted(p.relative_to(root).as_posix() for p in root.glob("data/*/*.parquet")) == [
        "data/chunk-000/file-000.parquet", "data/chunk-000/file-001.parquet", "data/chunk-001/file-000.parquet"]
    assert len(list(root.glob(f"videos/{CAMERAS[1]}/*/*.mp4"))) == 3
    dataset = open_dataset(root, {"action": [0.0, 0.1]})
    assert len(dataset) == 21
    for index in (0, 6, 7, 20):
        item = dataset[index]
        episode_index, frame_index = divmod(index, 7)
        assert torch.equal(item["action"][0], torch.from_numpy(episodes[episode_index]["action"][frame_index]))
        assert bool(item["action_is_pad"][1]) == (frame_index == 6)
        assert_frame_close(item[CAMERAS[1]], episodes[episode_index][CAMERAS[1]], frame_index, f"item {index}")


def test_av1(tmp_path, episodes):
    root = tmp_path / "av1"
    write(root, episodes[:1], video=VideoOptions(codec="av1"))
    assert json.loads((root / "meta" / "info.json").read_text())["features"][CAMERAS[0]]["info"]["video.codec"] == "av1"
    dataset = open_dataset(root)
    for index in (0, 7, 14):
        assert_frame_close(dataset[index][CAMERAS[0]], episodes[0][CAMERAS[0]], index, f"av1 item {index}")


def test_failed_writer_leaves_no_dataset(tmp_path, episodes):
    root = tmp_path / "broken"
    with pytest.raises(RuntimeError, match="boom"), LeRobotWriter(root, fps=FPS, features=FEATURES) as writer:
        writer.add_episode(episodes[0], task="x")
        raise RuntimeError("boom")
    assert not (root / "meta" / "info.json").exists()
    with pytest.raises(DatasetError, match="no meta/info.json"):
        open_dataset(root)


@pytest.mark.parametrize(("change", "message"), [
    (lambda e: e.pop("action"), "missing \\['action'\\]"),
    (lambda e: e.update(extra=np.zeros((NUM_FRAMES, 1))), "unknown \\['extra'\\]"),
    (lambda e: e.update(action=e["action"][:-1]), "same number of frames"),
    (lambda e: e.update(action=np.zeros((NUM_FRAMES, 5), np.float32)), "expected shape"),
    (lambda e: e.update(action=np.zeros((NUM_FRAMES, 4), np.complex64)), "do not fit dtype float32"),
    (lambda e: e.update({CAMERAS[0]: e[CAMERAS[0]].astype(np.float32)}), "expected uint8 frames"),
])
def test_bad_episodes_are_rejected(tmp_path, episodes, change, message):
    episode = dict(episodes[0])
    change(episode)
    writer = LeRobotWriter(tmp_path / "bad", fps=FPS, features=FEATURES)
    with pytest.raises(ValueError, match=message):
        writer.add_episode(episode, task="x")


def test_bad_setup_is_rejected(tmp_path, episodes):
    with pytest.raises(ValueError, match="even height and width"):
        LeRobotWriter(tmp_path / "a", fps=FPS, features={"cam": {"dtype": "video", "shape": [31, 32, 3]}})
    with pytest.raises(ValueError, match="filled in by the writer"):
        LeRobotWriter(tmp_path / "b", fps=FPS, features={"timestamp": {"dtype": "float32", "shape": [1]}})
    with pytest.raises(ValueError, match="codec 'vp9' is not supported"):
        VideoOptions(codec="vp9")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("x")
    with pytest.raises(DatasetError, match="--overwrite"):
        LeRobotWriter(tmp_path / "c", fps=FPS, features=FEATURES)
    with pytest.raises(ValueError, match="no episodes"):
        LeRobotWriter(tmp_path / "d", fps=FPS, features=FEATURES).close()
    writer = LeRobotWriter(tmp_path / "e", fps=FPS, features=FEATURES)
    writer.add_episode(episodes[0], task="x", extra={"success": True})
    with pytest.raises(ValueError, match="differ from the first episode"):
        writer.add_episode(episodes[1], task="x", extra={"seed": 1})
