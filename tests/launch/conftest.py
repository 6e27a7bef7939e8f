"""Fixtures for the launch tests: a local training run with a checkpoint of the recipe's model."""

from __future__ import annotations

import json

import pytest
import torch

from embodyhpc.checkpoint import Checkpointer
from embodyhpc.config.schema import CheckpointConfig
from embodyhpc.orchestrate.api import start_run
from embodyhpc.rundir import make_run_dir
from embodyhpc.validation import load_recipe

RECIPE = "recipes/demo_metaworld_cpu.yaml"


@pytest.fixture
def training_run(tmp_path):
    """A local training run directory (as submit made it) with a complete checkpoint step-40 of the recipe's model
    (tiny pi0.5: the export job refuses weights that do not fit the recipe)."""
    from embodyhpc.models import build_model

    (tmp_path / "demos").mkdir()
    loaded = load_recipe(RECIPE, [f"job.runs_root={tmp_path}", "eval.every_k_checkpoints=1",
                                  "checkpoint.every_steps=20", f"data.root={tmp_path / 'demos'}"])
    run = tmp_path / "demo" / "train-run"
    assert make_run_dir(run)
    start_run(loaded, run, backend="local", python="/venv/bin/python", mlflow_run_id="mlflow-parent")
    torch.manual_seed(0)
    model = build_model(loaded.config.model, loaded.config.precision)
    optimizer = torch.optim.AdamW(model.parameters())
    with Checkpointer(run / "checkpoints", CheckpointConfig(every_steps=20)) as ckpt:
        ckpt.save(40, model, optimizer, blocking=True)
    for name, content in side_files(loaded.config.model).items():  # what training writes next to checkpoints
        (run / "checkpoints" / name).write_text(json.dumps(content))
    return run, model


def side_files(model) -> dict[str, dict]:
    """normalization.json and policy_io.json as training writes them for the demo recipe's dataset (MetaWorld demos:
    one camera, 4 action dims, the 39-dim environment state)."""
    return {"normalization.json": {"key": model.state_key, "mode": model.state_norm, "offset": [0.5] * 39,
                                   "scale": [2.0] * 39},
            "policy_io.json": {"cameras": ["corner"], "image_size": 64, "state_key": model.state_key,
                               "action_dim": 4, "fps": 80}}
