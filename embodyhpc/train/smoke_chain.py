"""The smoke row `te fp8 resume + eval`: after its training steps, the chain a cluster run goes through in miniature.

A transformer-engine run's checkpoint must resume and its weights must evaluate on the first day on a cluster, and
neither can be seen without a GPU. So the row, once trained (delayed scaling: the recipe whose state TE always
keeps), saves a DCP checkpoint through the Checkpointer, builds a fresh model the way training does (meta build,
parallelize, materialize) and resumes it from that checkpoint, then exports the weights and loads them into the
model as evaluation builds it (no fp8 layers: embodyhpc.eval.trained). It fails its row where:
- the resumed model's te layers do not hold the FP8 scaling state that was saved (`_extra_state`: empty on a fresh
  layer, a payload once it ran in FP8), or the resume itself fails (DCP refuses a size difference);
- the export carries anything but weights, or does not fit the inference model;
- the inference model's loss on the row's fixed batch is not the trained model's, evaluated outside FP8.
The CPU tests drive this function with the transformer-engine double (tests/train/test_smoke_chain.py).
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def te_extra_states(model) -> dict[str, bytes]:
    """{module name: its get_extra_state() bytes} of every transformer-engine module."""
    return {name: bytes(module.get_extra_state().cpu().numpy().tobytes()) for name, module in model.named_modules()
            if type(module).__module__.startswith("transformer_engine")}


def resume_and_evaluate(model, optimizer, build: Callable[[], Any], model_cfg, loss_of: Callable[[Any], float], *,
                        step: int, device) -> dict[str, Any]:
    """The chain after `step` trained steps of `model` (see the module doc). `build()` returns a fresh model made as
    training makes it; `loss_of(model)` is the loss of the row's fixed batch, under no_grad and outside FP8.
    Returns {"ok", "reason", "te_layers", "state_bytes", "export_tensors", "loss_gap"}."""
    import torch

    from embodyhpc.checkpoint import Checkpointer
    from embodyhpc.checkpoint.export import check_fits, export_consolidated, load_exported
    from embodyhpc.config.schema import CheckpointConfig
    from embodyhpc.models import build_model

    saved = te_extra_states(model)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        checkpoints = Path(folder) / "saved"  # a scratch folder, not a run directory
        with Checkpointer(checkpoints, CheckpointConfig(every_steps=step)) as ckpt:
            ckpt.save(step, model, optimizer, blocking=True)
        # after the save: a forward outside FP8 empties a te layer's extra state (TE's fp8_checkpoint flag)
        reference = loss_of(model)
        fresh = build()
        with Checkpointer(checkpoints, CheckpointConfig(every_steps=step)) as ckpt:
            ckpt.load(step, fresh, torch.optim.AdamW(fresh.parameters()))
        restored = te_extra_states(fresh)
        export = Path(folder) / "export"
        export_consolidated(checkpoints / f"step-{step}", export, config_yaml="smoke: {}\n")
        weights, _ = load_exported(export)
        check_fits({k: (v.dtype, v.shape) for k, v in weights.items()}, model_cfg, where=str(export),
                   built_with="the smoke row's model config")
        inference = build_model(model_cfg)
        inference.load_state_dict(weights, strict=True)
        inference.to(device=device, dtype=torch.float32)
        evaluated = loss_of(inference)
    problems = []
    if not saved or not all(saved.values()):
        problems.append(f"{sum(not v for v in saved.values())} of {len(saved)} te layers hold no FP8 state after "
                        "training")
    lost = [name for name, payload in saved.items() if not _same_state(payload, restored.get(name, b""))]
    if lost:
        problems.append(f"{len(lost)} te layers did not get their FP8 state back on resume (e.g. {lost[0]})")
    gap = abs(evaluated - reference)
    if not gap <= 5e-2 * max(1.0, abs(reference)):  # bf16 compute in training, fp32 in evaluation
        problems.append(f"the evaluated model's loss {evaluated:.5f} is not the trained model's {reference:.5f}")
    return {"ok": not problems, "reason": "; ".join(problems) or None, "te_layers": len(saved),
            "state_bytes": sum(len(v) for v in saved.values()), "export_tensors": len(weights), "loss_gap": gap}


def _same_state(saved: bytes, restored: bytes) -> bool:
    """Whether two TE extra-state payloads hold the same recipe and scaling tensors. They are TE's own pickles (its
    set_extra_state unpickles them the same way); a payload pickled again need not have the same bytes."""
    import pickle

    import torch

    if not saved or not restored:
        return saved == restored
    want, got = pickle.loads(saved), pickle.loads(restored)
    if type(want.get("recipe")) is not type(got.get("recipe")):
        return False
    tensors = [key for key, value in want.items() if isinstance(value, torch.Tensor)]
    return all(isinstance(got.get(key), torch.Tensor) and torch.equal(got[key], want[key]) for key in tensors)
