"""Policies as plug-ins, selected by the recipe's `model.name` (spec.py: what a plug-in provides; protocol.py: what
the loop, parallel/, the checkpointer and evaluation may call on a model); attention backends; fp8. No distributed
code in here: models declare their FSDP wrap units (`fsdp_units()`), embodyhpc/parallel applies them.

Importing this package does not import torch (the CLI lists and validates models without it); builders load on
first use.
"""

from __future__ import annotations

from typing import Any

from embodyhpc.models.spec import ENTRY_POINT_GROUP, ModelSpec, available_models, model_spec, register_model

__all__ = ["ENTRY_POINT_GROUP", "ModelSpec", "available_models", "build_model", "build_tokenizer", "model_spec",
           "register_model", "registered_models"]


def registered_models() -> list[str]:
    return available_models()


def build_model(model_cfg: Any, precision_cfg: Any = None):
    """The policy named by model_cfg.name, built from the `model` section (and `precision` for fp8)."""
    return model_spec(model_cfg.name).load("build")(model_cfg, precision_cfg)


def build_tokenizer(model_cfg: Any):
    """The prompt tokenizer of the policy named by model_cfg.name (pi05: byte-level for tiny/small, else the file
    at model.tokenizer_path); None for a model that reads no text."""
    spec = model_spec(model_cfg.name)
    return None if spec.tokenizer is None else spec.load("tokenizer")(model_cfg)
