"""LeRobot fixture items -> Pi05Sample / Pi05Batch, and the model accepts the batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from embodyhpc.config.schema import ModelConfig
from embodyhpc.data import open_dataset
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_model, build_tokenizer
from embodyhpc.models.pi05.batching import Pi05Collate, batch_tokens, to_pi05_sample
from tests.train.workers import FIXTURE

HORIZON = 4


@pytest.fixture(scope="module")
def dataset():
    return open_dataset(FIXTURE, {"action": [i / 10 for i in range(HORIZON)]})


def _cfg(action_dim: int = 8, horizon: int = HORIZON, packing: bool = False) -> ModelConfig:
    return ModelConfig(size="tiny", action_horizon=horizon, action_dim=action_dim, max_token_len=128,
                       packing=packing)


def test_sample_shapes_and_padded_action_dims(dataset):
    item = dataset[0]
    sample = to_pi05_sample(item, _cfg(action_dim=8))
    assert sample.images.shape == (2, 3, 48, 48) and sample.images.dtype == torch.float32
    assert torch.equal(sample.images[0], item["observation.images.top"])  # sorted keys: top before wrist
    assert sample.state.shape == (6,) and sample.instruction == item["task"]
    assert sample.actions.shape == (HORIZON, 8) and sample.num_action_dims == 4
    assert torch.equal(sample.actions[:, :4], item["action"]) and not sample.actions[:, 4:].any()
    assert sample.action_is_pad.shape == (HORIZON,) and sample.action_is_pad.dtype == torch.bool


def test_more_dims_than_the_model_are_trimmed(dataset):
    sample = to_pi05_sample(dataset[0], _cfg(action_dim=3))
    assert sample.actions.shape == (HORIZON, 3) and sample.num_action_dims == 3


def test_wrong_chunk_length_names_the_key(dataset):
    with pytest.raises(ConfigError, match="delta_timestamps"):
        to_pi05_sample(dataset[0], _cfg(horizon=HORIZON + 1))


def test_collate_builds_a_batch_the_model_trains_on(dataset):
    torch.manual_seed(0)
    cfg = _cfg()
    collate_fn = Pi05Collate(cfg, build_tokenizer(cfg))
    batch = collate_fn([dataset[i] for i in (0, 1, 50)])
    assert batch.images.shape == (3, 2, 3, 32, 32) and batch.actions.shape == (3, HORIZON, 8)  # the tower's size
    assert batch.action_dim_mask[:, :4].all() and not batch.action_dim_mask[:, 4:].any()
    assert batch.action_is_pad.shape == (3, HORIZON) and batch.rows is None  # packing off: a row per sample
    assert batch.prompt_ids.shape[0] == 3 and (batch.prompt_lengths > 0).all()
    # 2 cameras x 16 patches (32 px tower, 8 px patches) + prompt + 4 action tokens per sample
    assert batch_tokens(batch, cfg) == int(batch.prompt_lengths.sum()) + 3 * (32 + HORIZON)
    model = build_model(cfg)
    loss = model(batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    # resizing in the collate is what the tower would have done itself
    unresized = replace(batch, images=torch.stack([to_pi05_sample(dataset[i], cfg).images for i in (0, 1, 50)]))
    with torch.no_grad():
        noise, time = torch.randn(3, HORIZON, 8), torch.rand(3)
        assert torch.allclose(model(batch, noise=noise, time=time).loss,
                              model(unresized, noise=noise, time=time).loss, atol=1e-6)


def test_packing_efficiency_is_useful_tokens_over_the_packed_rows_budget(dataset):
    from embodyhpc.models.pi05.batching import batch_token_budget
    from tests.parallel.harness import run_ranks
    from tests.train import workers

    cfg = _cfg()
    batch = Pi05Collate(cfg, build_tokenizer(cfg))([dataset[i] for i in (0, 1, 50)])
    assert batch_token_budget(batch, cfg) == 0, "an unpacked batch has no packing budget"
    packed = batch.with_rows([[0, 2], [1]])
    assert batch_token_budget(packed, cfg) == 2 * 128  # 2 rows of model.max_token_len
    # reduced over ranks: total useful tokens / total budget, the same on every rank
    results = run_ranks(workers.reduced_metrics_job, 2, [150, 90], [256, 128])
    assert [r["packing_efficiency"] for r in results] == [pytest.approx(240 / 384)] * 2
    assert results[0]["loss"] == pytest.approx(1.5)
    # without packing the field is absent, not 0 or NaN
    results = run_ranks(workers.reduced_metrics_job, 2, [150, 90], [0, 0])
    assert all("packing_efficiency" not in r for r in results)


def test_packing_collate_fills_rows_and_keeps_every_sample_loss(dataset):
    """Packed rows (first-fit decreasing into model.max_token_len) hold every sample once, within the budget, and
    each sample's loss is what it is in a padded batch."""
    cfg = _cfg(packing=True)
    cfg = replace(cfg, max_token_len=2 * 128)  # room for two samples per row
    items = [dataset[i] for i in (0, 1, 50, 60, 70)]
    packed = Pi05Collate(cfg, build_tokenizer(cfg))(items)
    padded = Pi05Collate(replace(cfg, packing=False), build_tokenizer(cfg))(items)
    rows = packed.rows
    assert sorted(i for row in rows for i in row) == list(range(5)) and len(rows) < 5
    counts = packed.token_counts(16, HORIZON)
    assert all(sum(counts[i] for i in row) <= cfg.max_token_len for row in rows)
    torch.manual_seed(0)
    model = build_model(cfg)
    noise, time = torch.randn(5, HORIZON, 8), torch.rand(5)
    with torch.no_grad():
        torch.testing.assert_close(model(packed, noise=noise, time=time).per_sample_loss,
                                   model(padded, noise=noise, time=time).per_sample_loss, atol=1e-5, rtol=1e-5)
