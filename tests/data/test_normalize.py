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
