"""Plug-ins named by text: a "module:attr" string imported on first use, and the package entry points of a group.

The model registry (models/spec.py), the suite and reference-policy registries (eval/suites.py, eval/references.py)
and the orchestration's job tasks (orchestrate/plan.py) name what they load this way, so that reading a recipe or a
plan imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any


def import_name(target: str) -> Any:
    """The attribute `attr` of module `module` for "module:attr" (the module is imported now)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def entry_points(group: str) -> dict[str, Any]:
    """{name: EntryPoint} of the installed packages' entry points in `group` (nothing is loaded)."""
    from importlib.metadata import entry_points as installed

    return {ep.name: ep for ep in installed(group=group)}


__all__ = ["entry_points", "import_name"]
