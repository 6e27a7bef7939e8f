"""model.state_input=expert: the continuous state reaches the action expert; the prompt then has no state."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model, build_tokenizer
from embodyhpc.models.pi05 import collate, max_prompt_tokens
from tests.models.conftest import ACTION_DIM, HORIZON, NUM_CAMERAS, make_samples


@pytest.fixture
def cfg() -> ModelConfig:
    return ModelConfig(size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM, max_token_len=160,
                       state_input="expert", state_dim=8)


def batch_of(cfg, samples, rows=None):
    return collate(samples, build_tokenizer(cfg), max_prompt_tokens=max_prompt_tokens(cfg, NUM_CAMERAS), rows=rows,
                   include_state=False)


def test_prompt_carries_no_state_and_the_model_reads_the_vector(cfg) -> None:
    torch.manual_seed(0)
    model = build_model(cfg)
    samples = make_samples(2)
    batch = batch_of(cfg, samples)
    with_state = collate(samples, build_tokenizer(cfg), max_prompt_tokens=max_prompt_tokens(cfg, NUM_CAMERAS))
    assert (batch.prompt_lengths < with_state.prompt_lengths).all()  # "State: ..." is gone from the prompt
    g = torch.Generator().manual_seed(1)
    noise, time = torch.randn(2, HORIZON, ACTION_DIM, generator=g), torch.rand(2, generator=g)
    moved = dataclasses.replace(batch, state=batch.state + 0.5)
    assert not torch.allclose(model(batch, noise=noise, time=time).per_sample_loss,
                              model(moved, noise=noise, time=time).per_sample_loss)
    loss = model(batch, noise=noise, time=time).loss
    loss.backward()
    assert model.state_in.weight.grad is not None and model.state_in.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("rows", [None, [[1, 2], [0]]], ids=["padded", "packed"])
def test_cached_sampling_equals_recomputing_with_state(cfg, rows) -> None:
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    batch = batch_of(cfg, make_samples(3, with_actions=False), rows=rows)
    noise = torch.randn(3, HORIZON, ACTION_DIM, generator=torch.Generator().manual_seed(3))
    cached = model.sample_actions(batch, noise=noise, num_steps=4)
    plain = model.sample_actions(batch, noise=noise, num_steps=4, use_kv_cache=False)
    torch.testing.assert_close(cached, plain, atol=1e-5, rtol=1e-5)


def test_a_state_wider_than_state_dim_is_refused(cfg) -> None:
    model = build_model(dataclasses.replace(cfg, state_dim=4))
    batch = batch_of(cfg, make_samples(1))  # 6-d states
    with pytest.raises(ValueError, match="model.state_dim"):
        model(batch)


def test_prompt_mode_builds_no_state_projection(cfg) -> None:
    assert build_model(dataclasses.replace(cfg, state_input="prompt")).state_in is None
