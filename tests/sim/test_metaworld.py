"""MetaWorld expert demos: written as LeRobot v3.0, read back by our reader, and reproducible from the metadata."""

from __future__ import annotations

import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers import require

os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo is imported: CPU rendering through Mesa's llvmpipe
require("metaworld", "sim")

from embodyhpc.data import open_dataset  # noqa: E402
from embodyhpc.errors import UserError  # noqa: E402
from embodyhpc.sim.metaworld import (  # noqa: E402
    INSTRUCTIONS,
    MT10_TASKS,
    CameraRenderer,
    generate_demos,
    instruction_for,
    make_env,
)

pytestmark = pytest.mark.sim  # steps a simulator

TASK = "reach-v3"  # the expert succeeds in 34-54 steps: short episodes keep this module fast
SIZE = 64
# Decoded frames against a fresh render of the same state: h264 at CRF 18 on yuv420p measured ~5 grey levels
# mean (3 of them from chroma subsampling alone); a frame turned the wrong way round is off by ~40.
IMAGE_MEAN_ATOL = 10 / 255


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    root = tmp_path_factory.mktemp("demos") / "reach"
    summary = generate_demos(root, tasks=[TASK], episodes_per_task=2, seed=7, image_size=SIZE, max_steps=120,
                             progress=False)
    return root, summary


def test_dataset_reads_back(demos):
    root, summary = demos
    assert summary.num_attempted == 2 and summary.num_episodes == 2 and summary.kept_by_task == {TASK: 2}
    dataset = open_dataset(root)
    assert len(dataset) == summary.num_frames == dataset.num_frames
    assert dataset.fps == 80 and dataset.video_keys == ["observation.images.corner"]
    assert dataset.tasks == {0: instruction_for(TASK)}
    item = dataset[0]
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in item.items() if isinstance(v, torch.Tensor)}
    assert shapes == {
        "observation.images.corner": ((3, SIZE, SIZE), torch.float32),
        "observation.state": ((4,), torch.float32),
        "observation.environment_state": ((39,), torch.float32),
        "action": ((4,), torch.float32),
        "next.reward": ((), torch.float32),
        "next.success": ((), torch.bool),
        "timestamp": ((), torch.float32),
        "frame_index": ((), torch.int64),
        "episode_index": ((), torch.int64),
        "index": ((), torch.int64),
        "task_index": ((), torch.int64),
    }
    assert item["task"] == "reach the red goal with the gripper"
    assert 0 <= float(item["observation.images.corner"].min()) and float(item["observation.images.corner"].max()) <= 1

    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    assert [(e["success"], e["env_name"], e["env_seed"], e["env_variant"]) for e in episodes] == [
        (True, TASK, 7, 0), (True, TASK, 7, 1)]
    for episode in episodes:
        last = dataset[episode["dataset_to_index"] - 1]
        assert bool(last["next.success"])  # episodes end at the first successful step
        assert not dataset[episode["dataset_from_index"]]["next.success"]
        assert episode["length"] <= 120


def test_replay_in_a_fresh_env_reproduces_the_recording(demos):
    root, _ = demos
    dataset = open_dataset(root)
    episodes = pq.read_table(root / "meta/episodes/chunk-000/file-000.parquet").to_pylist()
    for episode in episodes:
        rows = range(episode["dataset_from_index"], episode["dataset_to_index"])
        env = make_env(episode["env_name"], episode["env_seed"], episode["env_variant"])
        renderer = CameraRenderer(env.model, "corner", SIZE, SIZE)
        try:
            obs, _ = env.reset()
            for t, row in enumerate(rows):
                item = dataset[row]
                assert np.array_equal(obs.astype(np.float32), item["observation.environment_state"].numpy()), t
                assert np.array_equal(obs[:4].astype(np.float32), item["observation.state"].numpy()), t
                if t in (0, len(rows) - 1):  # the recorded image shows this state, upright
                    rendered = torch.from_numpy(renderer.render(env.unwrapped.data)).permute(2, 0, 1) / 255
                    error = (item["observation.images.corner"] - rendered).abs().mean()
                    upside_down_error = (item["observation.images.corner"] - rendered.flip(1, 2)).abs().mean()
                    assert error <= IMAGE_MEAN_ATOL < upside_down_error, (t, error * 255, upside_down_error * 255)
                obs, reward, _, _, info = env.step(item["action"].numpy())
                assert np.float32(reward) == item["next.reward"] and bool(info["success"]) == item["next.success"]
        finally:
            renderer.close()
            env.close()


@pytest.mark.slow
def test_same_seed_same_dataset_with_workers(demos, tmp_path):
    root, summary = demos
    again = generate_demos(tmp_path / "again", tasks=[TASK], episodes_per_task=2, seed=7, image_size=SIZE,
                           max_steps=120, progress=False, num_workers=2)
    assert again.num_frames == summary.num_frames
    for path in sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file()):
        assert (tmp_path / "again" / path).read_bytes() == (root / path).read_bytes(), path


def test_failed_episodes_are_dropped_unless_kept(tmp_path):
    with pytest.raises(RuntimeError, match="none of the 1 expert episodes succeeded within 3 steps"):
        generate_demos(tmp_path / "none", tasks=[TASK], episodes_per_task=1, max_steps=3, cameras=(),
                       progress=False)
    summary = generate_demos(tmp_path / "kept", tasks=[TASK], episodes_per_task=1, max_steps=3, cameras=(),
                             keep_failed=True, progress=False)
    assert summary.num_episodes == 1 and summary.num_frames == 3
    dataset = open_dataset(tmp_path / "kept")
    assert dataset.video_keys == [] and len(dataset) == 3
    assert pq.read_table(tmp_path / "kept/meta/episodes/chunk-000/file-000.parquet").column("success").to_pylist() == [
        False]


def test_corner_cameras_are_turned_upright():
    env = make_env(TASK, 0, 0)
    try:
        for camera, turned in (("corner3", True), ("topview", False), ("gripperPOV", False)):
            renderer = CameraRenderer(env.model, camera, 16, 16)
            assert renderer.rotate_180 == turned, camera
            renderer.close()
        with pytest.raises(ValueError, match="no camera 'nope'.*corner2"):
            CameraRenderer(env.model, "nope", 16, 16)
    finally:
        env.close()


def test_instructions_and_task_names():
    assert set(INSTRUCTIONS) == set(MT10_TASKS)
    assert instruction_for("push-v3") == "push the puck to the goal"
    assert instruction_for("coffee-pull-v3") == "coffee pull"
    with pytest.raises(UserError, match="unknown MetaWorld tasks \\['reach-v9'\\]"):
        generate_demos("/nonexistent/never-written", tasks=["reach-v9"], progress=False)
