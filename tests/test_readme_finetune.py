"""The README's fine-tuning section against the recipe schema: every recipe key it names exists with that spelling,
the defaults it states are the schema's, and each fine-tuning feature of issue 33 (EMA, dataset mixtures, LeRobot
v2.1, LoRA) is shown beside openpi's and GR00T's defaults.

The README is the reference the user reads; the schema (config/schema.py and its sections, the families' options,
the suites' options) is what the code reads. Neither is produced from the other.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
HEADING = "## Fine-tuning from published weights"
SECTIONS = "data|model|train|eval|precision|checkpoint|staging|parallelism|resources|tracking|job|network|rl"
KEY = re.compile(rf"`((?:{SECTIONS})\.[A-Za-z0-9_]+(?:\[[^\]`]*\])?(?:\.[A-Za-z0-9_]+(?:\[[^\]`]*\])?)*)")
ENTRY_ROW = re.compile(r"^\| `([a-z_]+)` \|", re.MULTILINE)  # the data.datasets entry table: bare keys

# (key, the README's wording that states its default, with the value as a group); None: optional (checked if there)
DEFAULTS = [
    ("train.ema_decay", r"leave it `(null)`, the default", True),
    ("model.lora.rank", r"`model\.lora\.rank` \| r; `(null)` \(the default\)", True),
    ("model.lora.alpha", r"`model\.lora\.alpha` \|[^|\n]*`(null)` = alpha = r", True),
    ("model.lora.targets", r"targets (\[\]) = the family's default", True),
    ("model.norm_stats", r"the default `(auto)`", True),
    ("eval.weights_kind", r"`raw`, or (unset) for the average", True),
    ("data.datasets[0].weight", r"\| `weight` \| > 0, default ([0-9.]+);", False),
]
TOPICS = {"EMA": "train.ema_decay", "dataset mixtures": "data.datasets", "LoRA": "model.lora",
          "LeRobot v2.1": "v2.1"}


def fine_tuning_section() -> str:
    text = README.read_text()
    start = text.index(HEADING)
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def _unwrap(hint):
    """X from X | None, list[X], dict[...] (None for a mapping: free keys below it)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else hint
    if origin is list:
        return _unwrap(typing.get_args(hint)[0])
    if origin is dict or hint is dict:
        return None
    return hint


def schema_default(key: str):
    """The schema's default of `key` (a[i].b reads the entry type's default); raises KeyError naming the first part
    that is not a key."""
    from embodyhpc.config.schema import Config

    cls, value = Config, None
    parts = re.sub(r"\[[^\]]*\]", "", key).split(".")
    for n, part in enumerate(parts):
        if cls is None or not dataclasses.is_dataclass(cls):
            return _free_key(parts[:n], parts[n:])
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if part not in fields:
            raise KeyError(".".join(parts[:n + 1]))
        f = fields[part]
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        cls = _unwrap(typing.get_type_hints(cls)[part])
    return value


def _free_key(section: list[str], rest: list[str]):
    """A key under a mapping: model.options.* must be some family's option, eval.suite_options.* some suite's."""
    from embodyhpc.eval.suites import available_suites, suite_option_names
    from embodyhpc.models.spec import available_models, model_spec

    where = ".".join(section)
    if where == "model.options":
        known = {f.name for name in available_models() if (opts := model_spec(name).options) is not None
                 for f in dataclasses.fields(opts)}
    elif where == "eval.suite_options":
        known = {option for suite in available_suites() for option in suite_option_names(suite)}
    else:
        return None  # a free mapping (data.delta_timestamps.action, ...)
    if rest[0] not in known:
        raise KeyError(f"{where}.{rest[0]}")
    return None


def _yaml(text: str):
    return {"null": None, "unset": None, "[]": []}.get(text, text if not re.fullmatch(r"[0-9.]+", text)
                                                       else float(text))


def test_every_key_the_section_names_is_a_recipe_key_with_the_stated_default():
    from embodyhpc.config.data_mixture import DatasetEntry

    text = fine_tuning_section()
    keys = sorted(k for k in set(KEY.findall(text)) if not re.search(r"\.(safetensors|json)\b", k))  # file names
    assert len(keys) >= 15, keys  # the section names many keys; a broken pattern would find none
    unknown = []
    for key in keys:
        try:
            schema_default(key)
        except KeyError as exc:
            unknown.append(f"{key} ({exc.args[0]} is not a recipe key)")
    entry_fields = {f.name for f in dataclasses.fields(DatasetEntry)}
    unknown += [f"data.datasets[i].{k}" for k in ENTRY_ROW.findall(text) if k not in entry_fields
                and not k.startswith(("model", "train", "data", "eval"))]
    assert not unknown, unknown
    assert {"root", "weight", "embodiment", "delta_timestamps", "eval"} <= set(ENTRY_ROW.findall(text))
    for key, wording, required in DEFAULTS:
        found = re.search(wording, text)
        assert found or not required, f"the README no longer states {key}'s default as {wording!r}"
        if found:
            assert schema_default(key) == _yaml(found.group(1)), (key, found.group(1), schema_default(key))


def _blocks(text: str) -> list[str]:
    return [b for b in re.split(r"\n\s*\n", text) if b.strip()]


def test_each_feature_is_shown_with_openpi_and_gr00t_defaults():
    """Per feature, a table with openpi and GR00T columns whose rows name its keys, or a paragraph that opens with
    the feature and says what openpi and GR00T do."""
    missing = []
    for topic, marker in TOPICS.items():
        shown = False
        for block in _blocks(fine_tuning_section()):
            lines = block.strip().splitlines()
            header = lines[0] if lines[0].startswith("|") else next((x for x in lines if x.startswith("|")), "")
            table = "openpi" in header and "GR00T" in header and any(
                marker in row for row in lines if row.startswith("|") and row is not header)
            paragraph = marker in lines[0] and "openpi" in block and "GR00T" in block
            shown = shown or table or paragraph
        if not shown:
            missing.append(topic)
    assert not missing, f"the fine-tuning section does not show openpi's and GR00T's defaults for {missing}"
