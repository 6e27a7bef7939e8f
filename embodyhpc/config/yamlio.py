"""Reading recipe YAML.

PyYAML follows YAML 1.1, where `01:30:00` is the base-60 integer 5400: in a recipe that would
silently turn a 90-minute Slurm time limit into 5400 minutes. Our loader keeps such values
as strings; everything else is PyYAML's safe loading (C-accelerated where available).
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class _RecipeLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """SafeLoader without YAML 1.1's base-60 numbers: `time: 01:30:00` must stay a string,
    not become the integer 5400 (which Slurm would read as 5400 minutes)."""


def _without_base60(regexp: re.Pattern) -> re.Pattern:
    """Drop the `1:30`-style alternatives from PyYAML's int/float patterns."""
    body = regexp.pattern.strip()
    assert body.startswith("^(?:") and body.endswith(")$"), body  # PyYAML's shape; tested
    kept = [alt for alt in body[4:-2].split("|") if "(?::[0-5]?[0-9])+" not in alt]
    return re.compile("^(?:" + "|".join(kept) + ")$", regexp.flags)


_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, _without_base60(regexp) if tag.endswith((":int", ":float")) else regexp)
            for tag, regexp in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
