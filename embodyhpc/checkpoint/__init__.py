"""Checkpoints: sharded DCP saves (async on a gloo group of their own) into `step-N` folders that count only once
marked complete; retention; resume on any world size; export of consolidated safetensors weights.

    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint, seed=cfg.train.seed)   # every rank
    loaded = ckpt.load_latest(model, optimizer)          # None on a fresh run; restores RNG streams
    start = loaded.step + 1 if loaded else 1
    ...
        if ckpt.due(step):
            ckpt.save(step, model, optimizer, sampler_state=sampler.state_dict(), extra={...})
    ckpt.save(last_step, model, optimizer, ..., blocking=True)
    ckpt.export(run_dir / "export", config_yaml=resolved_yaml_text)
    ckpt.close()

Importing this package imports torch (the CLI's light commands must not import it).
"""

from __future__ import annotations

from embodyhpc.checkpoint.checkpointer import Checkpointer, LoadResult, SaveResult
from embodyhpc.checkpoint.errors import CheckpointError, NotACheckpointError
from embodyhpc.checkpoint.export import consolidated_model_state, export_consolidated, load_exported
from embodyhpc.checkpoint.layout import list_steps, read_latest, read_marker
from embodyhpc.checkpoint.state import TrainerState

__all__ = ["CheckpointError", "Checkpointer", "LoadResult", "NotACheckpointError", "SaveResult", "TrainerState",
           "consolidated_model_state", "export_consolidated", "list_steps", "load_exported", "read_latest",
           "read_marker"]
