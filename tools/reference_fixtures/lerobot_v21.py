"""A LeRobot v2.1 dataset written by LeRobot 0.3.3's own writer, and what LeRobot 0.3.3's own v2.1 reader returns
for it, for tests/data/test_lerobot_v21.py.

Runs in its own venv (LeRobot 0.3.x is the last release that writes codebase v2.1; 0.4 writes v3.0), from the
repository root:

    python3.11 -m venv /work/lerobot03-venv
    /work/lerobot03-venv/bin/pip install lerobot==0.3.3 numpy==2.2.6   # numpy 2.4 crashes 0.3.3 on a [1] feature
    /work/lerobot03-venv/bin/python tools/reference_fixtures/lerobot_v21.py

Made with lerobot 0.3.3, torch 2.7.1, torchcodec 0.5 (LeRobot's default decoder, on the system FFmpeg), av 18.1.0
(LeRobot's encoder: libsvtav1, its defaults g=2, crf=30, yuv420p), datasets 3.6.0, numpy 2.4.6; the versions are
recorded in lerobot_v21_expected.json.

Writes (well under 1 MB):
- tests/data/fixtures/lerobot_v21_sample/: `LeRobotDataset.create` + `add_frame` + `save_episode`: 3 episodes of
  12, 7 and 9 frames at 10 fps, one camera `observation.images.cam` (32 x 32, encoded by LeRobot into one mp4 per
  episode), `observation.state` (3), `action` (2), `next.reward` (shape [1]: a 0-d tensor per item), two tasks
  (episode 2 switches task half-way, so task_index varies inside an episode).
- tests/data/fixtures/lerobot_v21_expected.npz: `LeRobotDataset(repo_id, root=..., delta_timestamps=...)[i]` for
  each mode in lerobot_v21_expected.json ("plain": none; "delta": history and chunk offsets that pad at both
  episode edges; "single": one video offset, which LeRobot squeezes to (C, H, W)): keys `<mode>/<i>/<key>`.
  Camera frames are stored as uint8 (the exact k/255 LeRobot returns, times 255: checked lossless here) with their
  returned dtype in the JSON; `stats/<feature>/<stat>` holds LeRobot's `meta.stats` (episodes_stats.jsonl
  aggregated by lerobot.datasets.compute_stats.aggregate_stats).
- tests/data/fixtures/lerobot_v21_expected.json: the delta_timestamps, indices, per item its keys, and for each
  key the dtype and shape LeRobot returned, and the task strings; versions and the command.

Frames and states are fixed functions of (episode, frame): re-running writes the same values (the mp4 bytes may
differ with another encoder build).

`--check-v30 DIR` instead reads DIR (what `embodyhpc data convert tests/data/fixtures/lerobot_v21_sample --out DIR`
wrote) with the LeRobot this venv has, and checks every recorded item against it: run with LeRobot 0.4.4 (the venv of
groot_head.py), it shows that LeRobot's own v3.0 reader reads the converted folder with LeRobot 0.3.3's values:

    .venv/bin/embodyhpc data convert tests/data/fixtures/lerobot_v21_sample --out /tmp/v30
    /work/lerobot-venv/bin/python tools/reference_fixtures/lerobot_v21.py --check-v30 /tmp/v30
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

if os.environ.get("PYTHONHASHSEED") != "0":  # LeRobot orders an episode's tasks through a set: fix the hash seed
    os.environ["PYTHONHASHSEED"] = "0"
    os.execv(sys.executable, [sys.executable, *sys.argv])

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lerobot.datasets.lerobot_dataset import CODEBASE_VERSION, LeRobotDataset  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "data" / "fixtures"
ROOT = FIXTURES / "lerobot_v21_sample"
REPO_ID = "embodyhpc/lerobot_v21_sample"
FPS = 10
SIZE = 32
CAMERA = "observation.images.cam"
LENGTHS = (12, 7, 9)
TASKS = ("pick up the red cube", "put the cube in the bowl")
DELTA = {
    "plain": None,
    "delta": {CAMERA: [-0.2, -0.1, 0.0], "observation.state": [-0.1, 0.0], "action": [0.0, 0.1, 0.2, 0.3]},
    "single": {CAMERA: [-0.1], "action": [0.0]},
}
# Every episode's first and last two frames (the pads), and one inside each episode.
INDICES = (0, 1, 5, 10, 11, 12, 13, 15, 17, 18, 19, 20, 23, 26, 27)


def frame_image(episode: int, frame: int) -> np.ndarray:
    """A 32 x 32 RGB frame: a colour ramp per episode, a bright 8 x 8 square that moves 3 px a frame."""
    y, x = np.mgrid[0:SIZE, 0:SIZE]
    image = np.zeros((SIZE, SIZE, 3), dtype=np.uint8)
    image[..., 0] = (x * 6 + 40 * episode) % 256
    image[..., 1] = (y * 6 + 20 * frame) % 256
    image[..., 2] = 60 + 50 * episode
    top, left = (frame * 3) % (SIZE - 8), (frame * 5 + 7 * episode) % (SIZE - 8)
    image[top:top + 8, left:left + 8] = 255
    return image


def write_dataset() -> None:
    features = {
        CAMERA: {"dtype": "video", "shape": (SIZE, SIZE, 3), "names": ["height", "width", "channels"]},
        "observation.state": {"dtype": "float32", "shape": (3,), "names": ["x", "y", "gripper"]},
        "action": {"dtype": "float32", "shape": (2,), "names": ["dx", "dy"]},
        "next.reward": {"dtype": "float32", "shape": (1,), "names": None},
    }
    dataset = LeRobotDataset.create(REPO_ID, FPS, features, root=ROOT, robot_type="so100", use_videos=True)
    for episode, length in enumerate(LENGTHS):
        for frame in range(length):
            task = TASKS[1] if episode == 1 or (episode == 2 and frame >= length // 2) else TASKS[0]
            value = 100 * episode + frame
            dataset.add_frame({
                CAMERA: frame_image(episode, frame),
                "observation.state": np.array([value, -value / 4, (frame % 3) / 2], dtype=np.float32),
                "action": np.array([value + 0.5, value / 8], dtype=np.float32),
                "next.reward": np.array([frame / length], dtype=np.float32),
            }, task=task)
        dataset.save_episode()
    shutil.rmtree(ROOT / "images", ignore_errors=True)  # LeRobot's emptied temporary frame folders


def record() -> None:
    arrays: dict[str, np.ndarray] = {}
    items: dict[str, dict] = {}
    for mode, delta in DELTA.items():
        dataset = LeRobotDataset(REPO_ID, root=ROOT, delta_timestamps=delta)
        if mode == "plain":
            arrays["len"], arrays["fps"] = np.array(len(dataset)), np.array(dataset.fps)
            for feature, stats in dataset.meta.stats.items():
                for stat, value in stats.items():
                    arrays[f"stats/{feature}/{stat}"] = np.asarray(value)
        for index in INDICES:
            item = dataset[index]
            described = {}
            for key, value in item.items():
                if isinstance(value, str):
                    described[key] = {"str": value}
                    continue
                array = value.numpy()
                described[key] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(array.shape)}
                if key == CAMERA:
                    as_uint8 = np.round(array * 255).astype(np.uint8)
                    assert np.array_equal(torch.from_numpy(as_uint8).float() / 255, value), "frames not k/255"
                    array = as_uint8
                arrays[f"{mode}/{index}/{key}"] = array
            items[f"{mode}/{index}"] = described
    np.savez_compressed(FIXTURES / "lerobot_v21_expected.npz", **arrays)
    versions = {name: version(name) for name in ("lerobot", "torch", "torchcodec", "av", "datasets", "numpy")}
    note = {
        "note": "what LeRobot 0.3.3's LeRobotDataset returns for lerobot_v21_sample (camera frames stored as uint8 = "
                "returned value * 255; their returned dtype is in items)",
        "command": "/work/lerobot03-venv/bin/python tools/reference_fixtures/lerobot_v21.py",
        "codebase_version": CODEBASE_VERSION, "versions": versions, "delta_timestamps": DELTA,
        "indices": list(INDICES), "episode_lengths": list(LENGTHS), "tasks": list(TASKS), "items": items,
    }
    (FIXTURES / "lerobot_v21_expected.json").write_text(json.dumps(note, indent=1) + "\n")


def check_v30(folder: Path) -> None:
    expected = json.loads((FIXTURES / "lerobot_v21_expected.json").read_text())
    with np.load(FIXTURES / "lerobot_v21_expected.npz") as npz:
        arrays = {k: npz[k] for k in npz.files}
    worst = 0.0
    for mode, delta in expected["delta_timestamps"].items():
        dataset = LeRobotDataset(REPO_ID, root=folder, delta_timestamps=delta)
        for index in expected["indices"]:
            item, want = dataset[index], expected["items"][f"{mode}/{index}"]
            assert sorted(item) == sorted(want), (mode, index, sorted(item))
            for key, spec in want.items():
                if "str" in spec:
                    assert item[key] == spec["str"], (mode, index, key)
                    continue
                got = item[key]
                assert (str(got.dtype).removeprefix("torch."), list(got.shape)) == (spec["dtype"], spec["shape"])
                value = arrays[f"{mode}/{index}/{key}"]
                if key == CAMERA:
                    worst = max(worst, float((got - torch.from_numpy(value).float() / 255).abs().max()))
                else:
                    assert torch.equal(got, torch.from_numpy(value)), (mode, index, key)
    print(f"lerobot {version('lerobot')} ({CODEBASE_VERSION}) reads {folder} with the recorded values; frames "
          f"differ by at most {worst * 255:.2f} grey levels")


def main() -> None:
    if sys.argv[1:2] == ["--check-v30"]:
        check_v30(Path(sys.argv[2]))
        return
    if ROOT.exists():
        shutil.rmtree(ROOT)
    write_dataset()
    record()
    size = sum(p.stat().st_size for p in ROOT.rglob("*") if p.is_file())
    size += sum((FIXTURES / f"lerobot_v21_expected.{ext}").stat().st_size for ext in ("npz", "json"))
    print(f"wrote {ROOT} and lerobot_v21_expected.{{npz,json}}: {size / 1e3:.1f} kB in all")


if __name__ == "__main__":
    main()
