"""A two-dataset mixture (data.datasets) trained through the real training loop (train/loop.py train(), FSDP2 over
gloo ranks, the tiny GR00T), stopped at a checkpoint and resumed on another world size.

The reference is an uninterrupted run of the same recipe: the (dataset, frame) each global draw position held there
must be what the interrupted run drew, before the checkpoint on 1 rank and after it on 2. What a sample is comes from
the item the loader returned (its `dataset_index` tag and the LeRobot `index` column of its parquet row), not from
the sampler's arithmetic. The statistics the run trains with are each dataset's own meta/stats.json (read here) and
survive the resume unchanged; a resume with other weights or another dataset at an entry is refused in one line,
and a refused resume leaves the run's statistics as they were.
"""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.data.test_mixture import write_robot
from tests.parallel.harness import run_ranks

pytestmark = [pytest.mark.slow]

HORIZON = 4
MICRO, GLOBAL = 2, 4
STEPS, STOP = 4, 2


def mixture_recipe(world_size: int, steps: int, datasets: list[dict], **model: Any) -> Any:
    from embodyhpc.config.coerce import build
    from embodyhpc.config.schema import (
        CheckpointConfig,
        Config,
        DataConfig,
        EvalConfig,
        ModelConfig,
        PrecisionConfig,
        ResourcesConfig,
        TrainConfig,
    )

    data = build(DataConfig, {"format": "lerobot", "datasets": datasets, "num_workers": 0,
                              "delta_timestamps": {"action": [i / 10 for i in range(HORIZON)]}}, "data.")
    return Config(
        resources=ResourcesConfig(nodes=1, tasks_per_node=world_size), data=data,
        model=ModelConfig(name="groot", size="tiny", action_horizon=HORIZON, action_dim=4, max_token_len=96,
                          state_norm="mean_std", **model),
        train=TrainConfig(steps=steps, global_batch_size=GLOBAL, micro_batch_size=MICRO, lr=1e-3, warmup_steps=1,
                          grad_clip=1.0, seed=5, log_every=1),
        precision=PrecisionConfig(mode="fp32"),
        checkpoint=CheckpointConfig(every_steps=STOP, keep_latest_k=3, async_save=False,
                                    export_final="init_weights" not in model),
        eval=EvalConfig(execute_steps=HORIZON))


def mixture_job(rank: int, world_size: int, run_dir: str, steps: int, datasets: list[dict], **model: Any) -> dict:
    """One rank of train() on the mixture; returns what it drew: (global position, dataset_index, frame index) per
    sample of every micro-batch the loader fetched, or the one-line error a refused resume raised."""
    from embodyhpc.config.resolve import resolve
    from embodyhpc.data.mixture import MixtureDataset
    from embodyhpc.errors import UserError
    from embodyhpc.train.loop import train

    drawn: list[tuple[int, int, int]] = []
    original = MixtureDataset.__getitems__

    def recording(self, positions):
        items = original(self, positions)
        drawn.extend((int(g), int(item["dataset_index"]), int(item["index"]))
                     for g, item in zip(positions, items, strict=True))
        return items

    MixtureDataset.__getitems__ = recording
    cfg = mixture_recipe(world_size, steps, datasets, **model)
    try:
        train(cfg, resolve(cfg), run_dir=run_dir, device="cpu", config_yaml="model: {name: groot, size: tiny}\n",
              dist_env=SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank))
    except UserError as exc:
        return {"error": str(exc), "drawn": drawn}
    finally:
        MixtureDataset.__getitems__ = original
    return {"error": None, "drawn": drawn}


def _order(results: list[dict], positions: range) -> list[tuple[int, int]]:
    """(dataset, frame) of each global position in `positions`, from every rank's records (prefetched ones past the
    last step included, then left out here)."""
    held: dict[int, tuple[int, int]] = {}
    for result in results:
        for g, dataset, frame in result["drawn"]:
            assert held.setdefault(g, (dataset, frame)) == (dataset, frame), g  # a position is one sample
    assert set(positions) <= set(held), (sorted(held), positions)
    return [held[g] for g in positions]


@pytest.fixture(scope="module")
def robots(tmp_path_factory):
    base = tmp_path_factory.mktemp("mixture-resume")
    return [write_robot(base / "a", 4, 4, 1.0, 0.0, seed=0), write_robot(base / "b", 6, 2, 50.0, 300.0, seed=1),
            write_robot(base / "c", 6, 2, 50.0, 300.0, seed=2)]  # c: b's shapes and length, other data


def test_a_resumed_mixture_run_draws_what_an_uninterrupted_one_draws(robots, tmp_path):
    a, b, c = robots
    datasets = [{"root": str(a), "weight": 3, "embodiment": "gr1"},
                {"root": str(b), "weight": 1, "embodiment": "oxe_droid"}]
    whole = run_ranks(mixture_job, 2, str(tmp_path / "whole"), STEPS, datasets, timeout_s=600)
    run = tmp_path / "stopped"
    first = run_ranks(mixture_job, 1, str(run), STOP, datasets, timeout_s=600)
    stats_file = run / "checkpoints" / "normalization_datasets.json"
    stats_before = stats_file.read_bytes()
    second = run_ranks(mixture_job, 2, str(run), STEPS, datasets, timeout_s=600)
    assert all(r["error"] is None for r in whole + first + second)

    reference = _order(whole, range(STEPS * GLOBAL))
    assert {d for d, _ in reference} == {0, 1}  # both datasets drawn
    resumed = _order(first, range(STOP * GLOBAL)) + _order(second, range(STOP * GLOBAL, STEPS * GLOBAL))
    assert resumed == reference
    assert min(g for r in second for g, _, _ in r["drawn"]) == STOP * GLOBAL  # nothing drawn again after the resume

    # each dataset's own statistics, kept as they were across the resume
    assert stats_file.read_bytes() == stats_before
    saved = json.loads(stats_before)["datasets"]
    for entry, root in zip(saved, (a, b), strict=True):
        stats = json.loads((root / "meta" / "stats.json").read_text())["observation.state"]
        np.testing.assert_allclose(entry["offset"], stats["mean"], rtol=1e-5)
        assert entry["root"] == str(root)

    # other weights: the checkpoint's mixture refuses to go on (one line, naming the entry)
    swapped = [dict(datasets[0], weight=1), dict(datasets[1], weight=3)]
    refused = run_ranks(mixture_job, 1, str(run), STEPS + 2, swapped, timeout_s=600)[0]["error"]
    assert refused is not None and "\n" not in refused and "data.datasets[0]'s weight was 3" in refused, refused
    # another dataset of the same length at an entry: refused before the run's statistics are rewritten
    other = [datasets[0], dict(datasets[1], root=str(c))]
    refused = run_ranks(mixture_job, 1, str(run), STEPS + 2, other, timeout_s=600)[0]["error"]
    assert refused is not None and "\n" not in refused and "data.datasets[1]" in refused, refused
    assert stats_file.read_bytes() == stats_before


def test_a_mixture_fine_tuned_from_weights_with_other_statistics_trains_on_its_own(robots, tmp_path):
    """model.init_weights carries the statistics of the dataset it was trained on (6 state values here); a mixture
    whose evaluation entry has 4 normalises with each dataset's own and must not be held to that set (it was:
    `statistics of observation.state have 6 values, the dataset's state has 4` at job start)."""
    a, b, _ = robots
    base = tmp_path / "base"
    assert run_ranks(mixture_job, 1, str(base), 2, [{"root": str(b)}], timeout_s=600)[0]["error"] is None
    assert len(json.loads((base / "export" / "normalization.json").read_text())["offset"]) == 6
    mixture = [{"root": str(a), "weight": 3, "embodiment": "gr1"}, {"root": str(b), "weight": 1}]
    tuned = tmp_path / "tuned"
    job = functools.partial(mixture_job, init_weights=str(base / "export"), norm_stats="auto")
    result = run_ranks(job, 1, str(tuned), 2, mixture, timeout_s=600)[0]
    assert result["error"] is None, result["error"]
    saved = json.loads((tuned / "checkpoints" / "normalization_datasets.json").read_text())["datasets"]
    for entry, root in zip(saved, (a, b), strict=True):
        stats = json.loads((root / "meta" / "stats.json").read_text())["observation.state"]
        np.testing.assert_allclose(entry["offset"], stats["mean"], rtol=1e-5)
