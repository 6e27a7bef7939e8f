"""pi0.5 (Physical Intelligence's VLA, published design) in our own PyTorch: see model.py for the method.

The folder is a model plug-in (embodyhpc/models/spec.py): SPEC declares its sizes and the family keys of the model
section it reads (all of them; state_input and state_dim are pi0.5's alone, checked by check_model), and names its
builder (build.py), batch builder and
token counts (batching.py), evaluation-time inference (inference.py), published-weights key rules (weights.py) and
what `embodyhpc smoke` trains (smoke.py), its LeRobot policy folder (lerobot.py).
Importing the package imports no torch (validate reads SPEC); the names below load their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from embodyhpc.config import checks
from embodyhpc.models.pi05.shapes import SHAPES
from embodyhpc.models.spec import ModelSpec

STATE_INPUTS = ("prompt", "expert")


def check_model(model_cfg) -> None:
    """pi0.5's own keys of the model section (at validate, without torch): how the state reaches the model."""
    checks.positive("model.state_dim", model_cfg.state_dim)
    checks.choice("model.state_input", model_cfg.state_input, STATE_INPUTS)


SPEC = ModelSpec(
    name="pi05",
    sizes=tuple(SHAPES),
    keys=("attention_backend", "tokenizer_path", "max_token_len", "packing", "state_input", "state_dim"),
    check=check_model,
    build="embodyhpc.models.pi05.build:build_pi05",
    tokenizer="embodyhpc.models.pi05.build:build_pi05_tokenizer",
    collate="embodyhpc.models.pi05.batching:Pi05Collate",
    token_count="embodyhpc.models.pi05.batching:batch_tokens",
    token_budget="embodyhpc.models.pi05.batching:batch_token_budget",
    inference="embodyhpc.models.pi05.inference:Pi05Runner",
    weights="embodyhpc.models.pi05.weights:ADAPTER",
    smoke="embodyhpc.models.pi05.smoke:SMOKE",
    lerobot_export="embodyhpc.models.pi05.lerobot:write",
    check_dataset="embodyhpc.models.pi05.dataset_fit:check_dataset",
    tokenizer_file=(("full", ("the full-size pi0.5 needs the PaliGemma tokenizer file", "/path/to/tokenizer.model")),),
)

_LAZY = {
    "Pi05Batch": "batch", "Pi05Sample": "batch", "collate": "batch",
    "FlowMatchingOutput": "model", "Pi05Policy": "model",
    "SHAPES": "shapes", "Pi05Shape": "shapes", "shape_for": "shapes",
    "build_pi05": "build", "build_pi05_tokenizer": "build", "max_prompt_tokens": "build",
}

__all__ = ["SPEC", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
