"""Checkpoints: sharded DCP saves (async on a gloo group of their own) into `step-N` folders that count only once
marked complete; retention; resume on any world size; export of consolidated safetensors weights.

    ckpt = Checkpointer(run_dir / "checkpoints", cfg.checkpoint, seed=cfg.train.seed)   # every rank
    loaded = ckpt.load_latest(model, optimizer, ema=ema)  # None on a fresh run; restores RNG streams (ema: optional)
    start = loaded.step + 1 if loaded else 1
    ...
        if ckpt.due(step):
            ckpt.save(step, model, optimizer, sampler_state=sampler.state_dict(), extra={...}, ema=ema)
    ckpt.save(last_step, model, optimizer, ..., blocking=True, ema=ema)
    ckpt.export(run_dir / "export", config_yaml=resolved_yaml_text, weights_kind=None)  # ema | raw | None
    ckpt.close()

The names below import torch when first used; `embodyhpc.checkpoint.layout` (folders, markers, pins) does not, so
the CLI's light commands may use it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Checkpointer": "checkpointer", "LoadResult": "checkpointer", "SaveResult": "checkpointer",
    "CheckpointError": "errors", "NotACheckpointError": "errors",
    "consolidated_model_state": "export", "export_consolidated": "export", "load_exported": "export",
    "list_steps": "layout", "read_latest": "layout", "read_marker": "layout",
    "TrainerState": "state",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
