"""Real checkpoints and exports for tests: a DCP step folder written by the Checkpointer, an export written from
it by export_consolidated (so export.json holds what the code records, sizes and hashes included)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from embodyhpc.checkpoint import Checkpointer
from embodyhpc.checkpoint.export import export_consolidated
from embodyhpc.config.schema import CheckpointConfig

SMALL_CONFIG_YAML = "job: {name: x}\n"


def small_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))


def save_checkpoint(checkpoints: Path, model: torch.nn.Module, step: int = 40) -> Path:
    """checkpoints/step-<step>, complete (model + AdamW), as training writes it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with Checkpointer(checkpoints, CheckpointConfig(every_steps=step)) as ckpt:
            ckpt.save(step, model, torch.optim.AdamW(model.parameters()), blocking=True)
    return checkpoints / f"step-{step}"


def make_export(out: Path, model: torch.nn.Module | None = None, config_yaml: str = SMALL_CONFIG_YAML,
                dtype: torch.dtype | None = None) -> Path:
    """An export folder at `out` (model.safetensors, config.yaml, export.json) of `model` (default: small_model)."""
    scratch = out.parent / f".{out.name}-checkpoints"
    step = save_checkpoint(scratch, model if model is not None else small_model())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        export_consolidated(step, out, config_yaml=config_yaml, dtype=dtype)
    return out
