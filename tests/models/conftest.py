"""Fixtures for model tests: the tiny pi0.5, its tokenizer, and small batches of synthetic samples."""

from __future__ import annotations

import pytest
import torch

from embodyhpc.config.schema import ModelConfig
from embodyhpc.models import build_model, build_tokenizer
from embodyhpc.models.pi05 import Pi05Batch, Pi05Sample, collate, max_prompt_tokens

HORIZON, ACTION_DIM, NUM_CAMERAS = 8, 8, 2
INSTRUCTIONS = ["pick up the cup", "open the top drawer", "push the red block to the left edge", "close it"]


@pytest.fixture(autouse=True)
def one_thread():
    """The CI machine has 2 shared cores: intra-op threads fight other processes and make tiny models 10-20x
    slower (measured), so model tests run single-threaded."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def flex_without_inductor(monkeypatch):
    """flex_attention goes through torch.compile as in production (dynamic shapes), lowered by the eager backend:
    inductor's C++ build of the CPU flex kernel takes ~20 s per shape here (measured). gpu tests use inductor."""
    from embodyhpc.models import attention

    if not torch.cuda.is_available():
        monkeypatch.setattr(attention, "FLEX_COMPILE_BACKEND", "eager")


@pytest.fixture
def te_double(monkeypatch):
    """transformer_engine imports the CPU double of tests/doubles (transformer-engine 2.9-2.18's API) for this test,
    which stands for a GPU node (TE_DOUBLE_CUDA=1: CPU tensors stand for CUDA ones). `te_double_without_gpu` is the
    same library on a node without CUDA, refusing as TE does."""
    from tests.helpers import DOUBLES, TE_DOUBLE_CUDA, drop_modules

    monkeypatch.setenv(TE_DOUBLE_CUDA, "1")
    monkeypatch.syspath_prepend(str(DOUBLES))
    drop_modules("transformer_engine")
    import transformer_engine

    yield transformer_engine
    drop_modules("transformer_engine")


@pytest.fixture
def te_double_without_gpu(te_double, monkeypatch):
    """transformer-engine (the double) installed on a node without CUDA: te.Linear's constructor and forward refuse."""
    from tests.helpers import TE_DOUBLE_CUDA

    monkeypatch.delenv(TE_DOUBLE_CUDA)
    return te_double


@pytest.fixture
def tiny_cfg() -> ModelConfig:
    return ModelConfig(size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM, max_token_len=160)


@pytest.fixture
def tiny_model(tiny_cfg):
    torch.manual_seed(0)
    return build_model(tiny_cfg)


def make_samples(num_samples: int, *, seed: int = 0, with_actions: bool = True, image_size: int = 32) -> list:
    g = torch.Generator().manual_seed(seed)
    return [Pi05Sample(images=torch.rand(NUM_CAMERAS, 3, image_size, image_size, generator=g),
                       instruction=INSTRUCTIONS[i % len(INSTRUCTIONS)], state=torch.rand(6, generator=g) * 2 - 1,
                       actions=torch.randn(HORIZON, ACTION_DIM, generator=g) if with_actions else None)
            for i in range(num_samples)]


def make_batch(cfg: ModelConfig, samples: list, rows=None) -> Pi05Batch:
    return collate(samples, build_tokenizer(cfg), max_prompt_tokens=max_prompt_tokens(cfg, NUM_CAMERAS), rows=rows)
