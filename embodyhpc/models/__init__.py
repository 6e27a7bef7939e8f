"""Policies, selected by the recipe's `model.name`; attention backends; fp8. No distributed code in here:
models declare their FSDP wrap units (`fsdp_units()`), embodyhpc/parallel applies them.

Importing this package does not import torch (the CLI lists models without it); builders load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from embodyhpc.errors import ConfigError

# name -> (module, model builder, tokenizer builder); builders take the recipe's `model` section
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "pi05": ("embodyhpc.models.pi05", "build_pi05", "build_pi05_tokenizer"),
}


def registered_models() -> list[str]:
    return sorted(_REGISTRY)


def register_model(name: str, module: str, builder: str, tokenizer_builder: str) -> None:
    """Make `model.name: <name>` build `<module>.<builder>(model_cfg, precision_cfg)` and its tokenizer with
    `<module>.<tokenizer_builder>(model_cfg)`."""
    _REGISTRY[name] = (module, builder, tokenizer_builder)


def _entry(model_cfg: Any, index: int):
    if model_cfg.name not in _REGISTRY:
        raise ConfigError(f"unknown model {model_cfg.name!r}; registered: {', '.join(registered_models())}",
                          key="model.name", fix=f"set model.name={registered_models()[0]}")
    entry = _REGISTRY[model_cfg.name]
    return getattr(importlib.import_module(entry[0]), entry[index])


def build_model(model_cfg: Any, precision_cfg: Any = None):
    """The policy named by model_cfg.name, built from the `model` section (and `precision` for fp8)."""
    return _entry(model_cfg, 1)(model_cfg, precision_cfg)


def build_tokenizer(model_cfg: Any):
    """The prompt tokenizer of the policy named by model_cfg.name (pi05: byte-level for tiny/small, else the file
    at model.tokenizer_path)."""
    return _entry(model_cfg, 2)(model_cfg)
