"""GR00T through the unchanged training loop on 2 gloo ranks: FSDP2 over its declared units with activation
checkpointing, packed VLM rows, the frozen VLM left as initialised, checkpoint and export of the plug-in's tensors."""

from __future__ import annotations

import json

import pytest
import torch

from embodyhpc.checkpoint import list_steps, load_exported
from embodyhpc.models import build_model
from tests.parallel.harness import run_ranks
from tests.train import groot_workers

STEPS = 3


@pytest.mark.slow
def test_two_ranks_train_groot_with_fsdp2(tmp_path):
    results = run_ranks(groot_workers.groot_train_job, 2, str(tmp_path), STEPS, timeout_s=300)
    assert [r["final_step"] for r in results] == [STEPS, STEPS]
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens_per_s"] > 0 for r in records)
    assert all(0 < r["packing_efficiency"] <= 1 for r in records), records
    assert list_steps(tmp_path / "checkpoints").newest_complete == STEPS
    weights, summary = load_exported(tmp_path / "export")
    assert summary["step"] == STEPS
    cfg = groot_workers.groot_recipe(2, STEPS)
    fresh = build_model(cfg.model)
    fresh.init_weights(seed=cfg.train.seed)  # what materialize filled every shard with, by the same rules
    initial = fresh.state_dict()
    assert set(weights) == set(initial)
    frozen = [k for k in initial if k.startswith("backbone.")]
    trained = [k for k in initial if k.startswith("action_head.model.transformer_blocks.")]
    assert all(torch.equal(weights[k], initial[k]) for k in frozen)  # the VLM is frozen in fine-tuning
    assert sum(not torch.equal(weights[k], initial[k]) for k in trained) >= len(trained) // 2


@pytest.mark.slow
def test_fine_tuning_starts_from_published_groot_weights(tmp_path):
    """model.init_weights with a file in the nvidia/GR00T-N1.5-3B layout: each rank reads its shards' rows through
    the spec's adapter; the frozen VLM leaves training exactly as published."""
    from embodyhpc.models.groot.weights import save_groot_weights, to_published

    cfg = groot_workers.groot_recipe(2, 2)
    torch.manual_seed(5)
    published_model = build_model(cfg.model)
    published_model.init_weights(seed=5)
    path = save_groot_weights(published_model, tmp_path / "GR00T-N1.5-3B")
    run_ranks(groot_workers.groot_train_job, 2, str(tmp_path / "run"), 2, str(path), timeout_s=300)
    weights, _ = load_exported(tmp_path / "run" / "export")
    published = published_model.state_dict()
    assert all(torch.equal(weights[k], published[k]) for k in published if k.startswith("backbone."))
    # the trained head moved by two Adam steps at most (~lr each), far less than the 0.02 spread of a fresh init
    head = [k for k in published if k.startswith("action_head.")]
    assert all(torch.allclose(weights[k], published[k], atol=3e-3) for k in head)
    assert to_published(weights, published_model.shape).keys() == to_published(published, published_model.shape).keys()
