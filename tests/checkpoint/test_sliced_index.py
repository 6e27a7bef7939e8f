"""A sharded checkpoint's index (model.safetensors.index.json) is data from whoever published it: model.init_weights
reads only shards that are plain file names beside the index. Each hostile index below would, if followed, load a
complete, valid set of weights from outside the checkpoint's folder: the refusal is the only way the test passes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from embodyhpc.checkpoint.sliced_weights import load_init_weights
from embodyhpc.models.weights_io import WeightsLayoutError

INDEX = "model.safetensors.index.json"


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


@pytest.fixture
def layout(tmp_path):
    """ckpt/ with two good shards of model 0; outside/ (a sibling) with all of model 1's weights in one file."""
    state = _model(0).state_dict()
    keys = sorted(state)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    shards = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    for name, part in shards.items():
        save_file({k: state[k].contiguous() for k in part}, str(folder / name))
    outside = tmp_path / "outside"
    outside.mkdir()
    save_file({k: v.contiguous() for k, v in _model(1).state_dict().items()}, str(outside / "stolen.safetensors"))
    good = {k: name for name, part in shards.items() for k in part}
    return folder, good, outside / "stolen.safetensors"


def _write_index(folder, weight_map) -> None:
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_plain_index_loads(layout):
    folder, good, _ = layout
    _write_index(folder, good)
    model = _model(7)
    assert load_init_weights(model, folder / INDEX, None).ok
    for key, value in _model(0).state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_a_shard_that_is_a_symlink_to_a_blob_loads(layout, tmp_path):
    """Hugging Face's cache keeps shards as symlinks into blobs/: the name is plain, the file may live anywhere."""
    folder, good, _ = layout
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    name = "model-00001-of-00002.safetensors"
    os.replace(folder / name, blobs / "0123abcd")
    (folder / name).symlink_to(blobs / "0123abcd")
    _write_index(folder, good)
    assert load_init_weights(_model(7), folder, None).ok


HOSTILE = {
    "parent-relative": lambda outside: "../outside/stolen.safetensors",
    "absolute": lambda outside: str(outside),
    "dot-slash-then-up": lambda outside: "./../outside/stolen.safetensors",
    "subfolder-then-up": lambda outside: "model-00001-of-00002.safetensors/../../outside/stolen.safetensors",
    "backslashes": lambda outside: "..\\outside\\stolen.safetensors",
    "dot-dot": lambda outside: "..",
    "dot": lambda outside: ".",
    "empty": lambda outside: "",
    "nul-byte": lambda outside: "model-00001-of-00002.safetensors\0.txt",
    "a-number": lambda outside: 7,
    "null": lambda outside: None,
    "a-list": lambda outside: ["model-00001-of-00002.safetensors"],
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_shard_name_outside_the_folder_is_refused(layout, case):
    folder, good, outside = layout
    hostile = HOSTILE[case](outside)
    first = sorted(good)[0]
    _write_index(folder, {**good, first: hostile})
    model = _model(7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsLayoutError, match="not a file name beside the index") as caught:
        load_init_weights(model, folder / INDEX, None)
    assert "\n" not in str(caught.value) and first in str(caught.value)
    for key, value in model.state_dict().items():  # nothing was loaded
        assert torch.equal(value, before[key]), key


def test_every_tensor_from_outside_is_refused_too(layout):
    """Not one hostile entry among good ones: the whole map points at the outside file."""
    folder, good, outside = layout
    _write_index(folder, dict.fromkeys(good, "../outside/stolen.safetensors"))
    with pytest.raises(WeightsLayoutError, match="not a file name beside the index"):
        load_init_weights(_model(7), folder, None)


BROKEN = {
    "not-json": ("{", "not valid JSON"),
    "a-list": ("[1, 2]", 'no "weight_map"'),
    "no-weight-map": (json.dumps({"metadata": {}}), 'no "weight_map"'),
    "empty-weight-map": (json.dumps({"weight_map": {}}), 'no "weight_map"'),
    "weight-map-a-list": (json.dumps({"weight_map": ["a"]}), 'no "weight_map"'),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_index_is_one_line(layout, case):
    folder, _, _ = layout
    text, expected = BROKEN[case]
    (folder / INDEX).write_text(text)
    with pytest.raises(WeightsLayoutError, match=expected) as caught:
        load_init_weights(_model(7), folder, None)
    assert "\n" not in str(caught.value)


def test_an_index_that_puts_a_tensor_in_the_wrong_shard_is_refused(layout):
    folder, good, _ = layout
    keys = sorted(good)
    swapped = {**good, keys[0]: good[keys[-1]]}
    assert swapped[keys[0]] != good[keys[0]]
    _write_index(folder, swapped)
    with pytest.raises(WeightsLayoutError, match=f"puts {keys[0]} in .* which does not hold it"):
        load_init_weights(_model(7), folder, None)
