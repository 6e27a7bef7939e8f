"""pi0.5 (Physical Intelligence's VLA, published design) in our own PyTorch: see model.py for the method.

The folder is a model plug-in (embodyhpc/models/spec.py): SPEC names its builder (build.py), batch builder and
token counts (batching.py), evaluation-time inference (inference.py), published-weights key rules (weights.py) and
what `embodyhpc smoke` trains (smoke.py).
Importing the package imports no torch (validate reads SPEC); the names below load their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from embodyhpc.models.spec import ModelSpec

SPEC = ModelSpec(
    name="pi05",
    build="embodyhpc.models.pi05.build:build_pi05",
    tokenizer="embodyhpc.models.pi05.build:build_pi05_tokenizer",
    collate="embodyhpc.models.pi05.batching:Pi05Collate",
    token_count="embodyhpc.models.pi05.batching:batch_tokens",
    token_budget="embodyhpc.models.pi05.batching:batch_token_budget",
    inference="embodyhpc.models.pi05.inference:Pi05Runner",
    weights="embodyhpc.models.pi05.weights:ADAPTER",
    smoke="embodyhpc.models.pi05.smoke:SMOKE",
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
