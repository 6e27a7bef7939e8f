"""State normalisation from dataset statistics: both modes, constant dims, numpy/torch agree, save/load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from embodyhpc.data.normalize import StateNormalizer
from embodyhpc.errors import UserError

STATS = {"observation.state": {"mean": [1.0, -2.0, 5.0], "std": [2.0, 0.5, 0.0],
                               "q01": [-1.0, -3.0, 5.0], "q99": [3.0, -1.0, 5.0]}}


def test_mean_std_and_constant_dims() -> None:
    norm = StateNormalizer.from_stats(STATS, "observation.state", "mean_std")
    out = norm(np.array([[3.0, -2.5, 7.0]], np.float32))
    np.testing.assert_allclose(out, [[1.0, -1.0, 0.0]])  # (3-1)/2, (-2.5+2)/0.5, constant dim -> 0


def test_quantile_maps_q01_q99_to_the_unit_interval_and_clips() -> None:
    norm = StateNormalizer.from_stats(STATS, "observation.state", "quantile")
    out = norm(np.array([-1.0, -1.0, 5.0], np.float32))
    np.testing.assert_allclose(out, [-1.0, 1.0, 0.0])
    np.testing.assert_allclose(norm(np.array([9.0, -9.0, 0.0], np.float32)), [1.0, -1.0, 0.0])


def test_torch_and_numpy_give_the_same_values(tmp_path) -> None:
    norm = StateNormalizer.from_stats(STATS, "observation.state", "mean_std")
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    np.testing.assert_allclose(norm(torch.from_numpy(x)).numpy(), norm(x), rtol=1e-6)
    norm.save(tmp_path)
    assert StateNormalizer.load(tmp_path) == norm
    assert StateNormalizer.load(tmp_path / "nowhere") is None


def test_dataset_without_stats_or_key_is_a_user_error(tmp_path) -> None:
    with pytest.raises(UserError, match="meta/stats.json"):
        StateNormalizer.from_dataset(tmp_path, "observation.state", "mean_std")
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "stats.json").write_text(json.dumps(STATS))
    with pytest.raises(UserError, match="model.state_key"):
        StateNormalizer.from_dataset(tmp_path, "observation.nope", "mean_std")
    assert StateNormalizer.from_dataset(tmp_path, "observation.nope", "none").mode == "none"


# a saved normalization.json (what an evaluation feeds the policy with) that is there but wrong: one line naming the
# file and the field, never NaN actions or a KeyError
GOOD = {"key": "observation.state", "mode": "mean_std", "offset": [1.0, -2.0], "scale": [2.0, 0.0]}
BAD_FILES = [
    ("empty", "", "unreadable"),
    ("not-json", "{", "unreadable"),
    ("not-utf8", b"\xff\xfe", "unreadable"),
    ("a-list", "[1, 2]", "not a JSON object"),
    ("no-scale", json.dumps({k: v for k, v in GOOD.items() if k != "scale"}), "no 'scale' entry"),
    ("key-not-text", json.dumps({**GOOD, "key": 3}), "key: not a feature name"),
    ("unknown-mode", json.dumps({**GOOD, "mode": "minmax"}), "mode: 'minmax' is not one of"),
    ("nan-offset", json.dumps({**GOOD, "offset": [float("nan"), 1.0]}), "offset[0]: nan is not finite"),
    ("infinite-scale", json.dumps({**GOOD, "scale": [1.0, float("inf")]}), "scale[1]: inf is not finite"),
    ("negative-scale", json.dumps({**GOOD, "scale": [1.0, -0.5]}), "scale[1]: -0.5 is negative"),
    ("text-values", json.dumps({**GOOD, "offset": ["1", "2"]}), "offset: not a list of numbers"),
    ("bool-values", json.dumps({**GOOD, "offset": [True, False]}), "offset: not a list of numbers"),
    ("nested", json.dumps({**GOOD, "offset": [[1.0, 2.0]]}), "offset: not a list of numbers"),
    ("lengths-differ", json.dumps({**GOOD, "scale": [1.0]}), "offset: 2 values, scale has 1"),
    ("statistics-without-values", json.dumps({**GOOD, "offset": [], "scale": []}), "with no statistics"),
]


@pytest.mark.parametrize(("case", "content", "expected"), BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_a_broken_saved_normalizer_is_one_line(tmp_path, case, content, expected) -> None:
    path = tmp_path / "normalization.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=expected.replace("[", r"\[").replace("]", r"\]")) as caught:
        StateNormalizer.load(tmp_path)
    line = caught.value.one_line()
    assert str(path) in line and "\n" not in line and "fix:" in line


def test_a_saved_normalizer_without_statistics_is_fine_for_mode_none(tmp_path) -> None:
    (tmp_path / "normalization.json").write_text(json.dumps({"key": "s", "mode": "none", "offset": [], "scale": []}))
    assert StateNormalizer.load(tmp_path) == StateNormalizer("s", "none")
    (tmp_path / "normalization.json").write_text(json.dumps(GOOD))
    assert StateNormalizer.load(tmp_path) == StateNormalizer("observation.state", "mean_std", (1.0, -2.0), (2.0, 0.0))
