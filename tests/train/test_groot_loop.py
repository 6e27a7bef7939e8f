"""GR00T through the unchanged training loop on 2 gloo ranks: FSDP2 over its declared units with activation
checkpointing, packed VLM rows, the frozen VLM left as initialised, checkpoint and export of the plug-in's tensors."""

from __future__ import annotations

import json

import torch

from embodyhpc.checkpoint import list_steps, load_exported
from embodyhpc.models import build_model
from tests.parallel.harness import run_ranks
from tests.train import groot_workers

STEPS = 3


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
