"""Damaged datasets: a truncated video, a corrupt HDF5 chunk, a truncated parquet file. Each is a one-line error
naming the file (and, for a sample, its episode and frame) instead of a decoder's or pyarrow's own exception; through
the training loader, the run fails with it, or skips exactly the samples it breaks with data.on_bad_sample=skip."""

from __future__ import annotations

import json

import numpy as np
import pytest

from embodyhpc.config.schema import DataConfig
from embodyhpc.data import DatasetError, open_dataset
from embodyhpc.data.errors import DataWorkerError, SampleError
from embodyhpc.data.loader import build_dataloader
from tests.helpers import require

CHUNK = {"action": [0.0, 0.1, 0.2]}
TOP = "videos/observation.images.top/chunk-000/file-000.mp4"


def _truncate(path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _unreadable(dataset) -> dict[int, str]:
    out = {}
    for index in range(len(dataset)):
        try:
            dataset[index]
        except SampleError as exc:
            out[index] = str(exc)
    return out


@pytest.fixture
def truncated_video(sample_copy):
    _truncate(sample_copy / TOP, 0.5)  # the second half of the concatenated episodes is gone
    return sample_copy


@pytest.mark.parametrize("backend", ["torchcodec", "pyav"])
def test_a_truncated_video_names_the_file_episode_and_frame(truncated_video, backend):
    if backend == "torchcodec":
        require("torchcodec.decoders", "data")
    dataset = open_dataset(truncated_video, CHUNK, video_backend=backend)
    bad = _unreadable(dataset)
    assert bad and len(bad) < len(dataset)  # the first episodes still decode
    index, message = min(bad.items())
    assert "\n" not in message and message.startswith(f"{truncated_video / TOP}: episode ")
    episode = int(message.split("episode ")[1].split(",")[0])
    first = int(dataset._episodes["dataset_from_index"][episode])  # the episode's first row, as meta/episodes says
    assert f"frame {index - first} (index {index}): cannot decode observation.images.top" in message
    assert "(fix: re-encode or restore this video file" in message


def test_a_corrupt_hdf5_chunk_names_the_file_and_the_demo(tmp_path):
    h5py = require("h5py", "data")
    path = tmp_path / "demos.hdf5"
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        data.attrs["problem_info"] = json.dumps({"language_instruction": "lift the cube"})
        for n in range(2):
            demo = data.create_group(f"demo_{n}")
            demo.create_dataset("obs/state", data=np.random.rand(50, 3), chunks=(10, 3), compression="gzip")
            demo.create_dataset("actions", data=np.random.rand(50, 2), chunks=(10, 2), compression="gzip")
    with h5py.File(path, "r") as f:
        chunk = f["data/demo_1/actions"].id.get_chunk_info(2)  # steps 20..29 of demo_1
    raw = bytearray(path.read_bytes())
    raw[chunk.byte_offset: chunk.byte_offset + chunk.size] = b"\xff" * chunk.size
    path.write_bytes(bytes(raw))

    bad = _unreadable(open_dataset(path))
    assert sorted(bad) == list(range(70, 80))
    assert bad[73].startswith(f"{path}: episode 1 (data/demo_1), step 23: cannot read action (OSError: ")


@pytest.mark.parametrize("relative", ["data/chunk-000/file-000.parquet", "meta/episodes/chunk-000/file-000.parquet"])
def test_a_truncated_parquet_file_is_named_when_the_dataset_opens(sample_copy, relative):
    _truncate(sample_copy / relative, 0.6)
    with pytest.raises(DatasetError) as raised:
        open_dataset(sample_copy, CHUNK)
    message = str(raised.value)
    assert message.startswith(f"{sample_copy / relative}: cannot read parquet: ") and "\n" not in message


def _loader(root, on_bad_sample: str):
    dataset = open_dataset(root, CHUNK)
    data = DataConfig(format="lerobot", root=str(root), num_workers=2, on_bad_sample=on_bad_sample)
    return dataset, build_dataloader(dataset, data, micro_batch_size=4, rank=0, world_size=1, seed=1)[0]


def test_through_the_loader_a_truncated_video_fails_the_run_naming_it(truncated_video):
    _, loader = _loader(truncated_video, "error")
    try:
        with pytest.raises(DataWorkerError, match=rf"failed reading sample \d+: SampleError: {truncated_video / TOP}"
                                                  r": episode \d+, frame \d+"):
            for _ in loader:
                pass
    finally:
        loader.close()


def test_with_skip_the_loader_trains_on_the_readable_samples_and_counts_the_rest(truncated_video):
    dataset, loader = _loader(truncated_video, "skip")
    try:
        seen = [int(i) for batch in loader for i in batch["index"]]
    finally:
        loader.close()
    # which frames right at the cut still decode depends on the decoder's position (the order samples come in), so
    # the count is checked against what was trained on: every frame once, either trained on or skipped
    assert len(seen) == len(set(seen)) and loader.skipped_samples == len(dataset) - len(seen) > 0
    assert set(range(30)) <= set(seen)  # episode 0 lies wholly in the first half of the video
    assert len(seen) > len(dataset) - len(_unreadable(dataset)) - 5
