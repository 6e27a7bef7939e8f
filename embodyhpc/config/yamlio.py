"""Reading recipe YAML, safely.

PyYAML follows YAML 1.1, where `01:30:00` is the base-60 integer 5400: in a recipe that would
silently turn a 90-minute Slurm time limit into 5400 minutes. Likewise `010` is 8 (octal) in YAML 1.1 and 10 in
YAML 1.2, and `0x10`, `0b11`, `1_000` are numbers to one reader and text to another. Our loader reads as numbers
only what every reader agrees on (plain decimal integers, decimal floats) and keeps the rest as the text written:
a string field keeps `010` as written, and an integer field refuses it with the decimal to write
(embodyhpc.config.coerce), from a file and from an override alike. Everything else is PyYAML's safe loading
(C-accelerated where available).

Recipes are shared between users, so a recipe is hostile input until checked. Before anything is
built, one pass over libyaml's event stream (iterative: no recursion that deep nesting could
overflow) checks the document's size once aliases are expanded, its nesting depth and its tags.
An alias bomb ("billion laughs") is a few hundred bytes that expand to billions of nodes; every
later walk of the data (schema checks, OmegaConf interpolation) would hang on it. Duplicate keys
are refused (YAML says keys are unique; PyYAML keeps the last one, silently dropping a section).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # recipes are a few KB; a 1 MiB recipe is a mistake or an attack
MAX_DEPTH = 32  # recipe sections nest 3-4 levels
MAX_NODES = 100_000  # scalars + collections after aliases are expanded
MAX_ALIASES = 1_000
_STANDARD = "tag:yaml.org,2002:"
_ALLOWED_TAGS = {None, "!", *(f"{_STANDARD}{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq"))}


class YAMLLimitError(yaml.YAMLError):
    """The document breaks a limit (size, depth, aliases, tags, duplicate keys). `problem` says which."""

    def __init__(self, problem: str, line: int | None = None) -> None:
        super().__init__(problem)
        self.problem = problem
        self.line = line  # 1-based


_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _RecipeLoader(_Base):  # type: ignore[misc,valid-type]
    """SafeLoader whose numbers are plain decimals only: `time: 01:30:00` stays a string, not the integer 5400
    (which Slurm would read as 5400 minutes), and `steps: 010` the text "010", not 8. Duplicate keys raise."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: SafeConstructor reports it
                break
            if duplicate:
                raise YAMLLimitError(f"duplicate key {key!r} (the second would silently replace the first)",
                                     key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# Plain decimals only: no base 60 (1:30), octal (010, 0o10), hexadecimal, binary or digit separators (1_000).
# A float keeps YAML 1.1's shape (a dot; an exponent with a sign), so `1e3` stays text as before.
_INT = re.compile(r"^[-+]?(?:0|[1-9][0-9]{0,19})$")  # longer: text (Python refuses to convert 4300+ digits)
_FLOAT = re.compile(r"^(?:[-+]?[0-9]+\.[0-9]*(?:[eE][-+][0-9]+)?|\.[0-9]+(?:[eE][-+][0-9]+)?"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")
_NUMBER = {"tag:yaml.org,2002:int": _INT, "tag:yaml.org,2002:float": _FLOAT}

_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, _NUMBER.get(tag, regexp)) for tag, regexp in resolvers]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def check_limits(text: str) -> None:
    """Refuse a document whose expansion, depth, aliases or tags exceed what a recipe needs, without building it.

    Each anchored node's expanded size is computed once from the event stream, so an alias costs its
    anchor's size: the total is exact and the pass is linear in the text.
    """
    if len(text) > MAX_BYTES:
        raise YAMLLimitError(f"the file is larger than {MAX_BYTES >> 10} KiB")
    anchors: dict[str, int] = {}
    stack: list[list[Any]] = []  # [anchor, expanded size so far] per open collection
    total = depth = aliases = 0

    def add(size: int) -> None:
        nonlocal total
        if stack:
            stack[-1][1] += size
        else:
            total += size
        if total + sum(frame[1] for frame in stack) > MAX_NODES:
            raise YAMLLimitError(f"it expands to more than {MAX_NODES} values (aliases of aliases: a YAML bomb?)",
                                 line)

    for event in yaml.parse(text, Loader=_Base):
        line = event.start_mark.line + 1 if event.start_mark is not None else None
        tag = getattr(event, "tag", None)
        if tag not in _ALLOWED_TAGS and not isinstance(event, (yaml.StreamStartEvent, yaml.DocumentStartEvent)):
            raise YAMLLimitError(f"the tag {tag} is not allowed in a recipe (plain values, lists and mappings only)",
                                 line)
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise YAMLLimitError(f"it nests deeper than {MAX_DEPTH} levels", line)
            stack.append([event.anchor, 1])
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
            anchor, size = stack.pop()
            if anchor is not None:
                anchors[anchor] = size
            add(size)
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                anchors[event.anchor] = 1
            add(1)
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_ALIASES:
                raise YAMLLimitError(f"it uses more than {MAX_ALIASES} aliases", line)
            add(anchors.get(event.anchor, 1))  # an unknown anchor: the loader reports it


def load_yaml(text: str) -> Any:
    check_limits(text)
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
