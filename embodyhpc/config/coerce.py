"""Build the schema dataclasses from merged plain data, checking and converting types.

Conversions follow OmegaConf's structured-config rules for the types the schema uses (int,
float, bool, str, Optional, List, Dict, nested dataclasses) so recipes behave the same; doing
it here keeps `embodyhpc render` off OmegaConf's import and node machinery (CLI latency).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Union

from embodyhpc.errors import ConfigError

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
INT64_MAX = 2**63 - 1
_NONFINITE = ("inf", "infinity", "nan")  # refused as not finite (a clearer message than "not a number")
_DECIMAL_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)")
_DECIMAL_FLOAT = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
# integers YAML 1.1, YAML 1.2 and Python read differently (or only some of them read): (pattern, what, the value)
_AMBIGUOUS_INTS: tuple[tuple[re.Pattern, Callable[[str], str], Callable[[str], int]], ...] = (
    (re.compile(r"[-+]?0[0-9]+"),
     lambda t: "has a leading zero: YAML 1.1 reads it as octal" + (f" ({int(t, 8)})" if re.fullmatch(r"[-+]?[0-7]+", t)
                                                                 else "") + ", YAML 1.2 as decimal",
     lambda t: int(t, 10)),
    (re.compile(r"[-+]?0[xX][0-9a-fA-F_]+"), lambda t: "is hexadecimal", lambda t: int(t, 16)),
    (re.compile(r"[-+]?0[oO][0-7_]+"), lambda t: "is octal (YAML 1.2's way)", lambda t: int(t, 8)),
    (re.compile(r"[-+]?0[bB][01_]+"), lambda t: "is binary", lambda t: int(t, 2)),
    (re.compile(r"[-+]?[0-9][0-9_]*_[0-9_]*"), lambda t: "has digit separators, which YAML 1.2 reads as text",
     lambda t: int(t, 10)),
    (re.compile(r"[-+]?[0-9]+(?::[0-5]?[0-9])+"), lambda t: "is a YAML 1.1 base-60 number",
     lambda t: (-1 if t.startswith("-") else 1) * functools.reduce(lambda a, b: a * 60 + int(b),
                                                                  t.lstrip("+-").split(":"), 0)),
)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _short(text: str) -> str:
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def _wrong(key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"wrong type: expected {expected}, got {_short(repr(value))}", key=key)


def coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return coerce(value, inner, key)
    if value is None:
        raise _wrong(key, getattr(hint, "__name__", str(hint)), value)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"wrong type: expected a mapping, got {value!r}", key=key)
        return build(hint, value, f"{key}.")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"wrong type: expected a list, e.g. [a, b], got {value!r}", key=key)
        return [coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"wrong type: expected a mapping, got {value!r}", key=key)
        return {str(k): coerce(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise _wrong(key, "true or false", value)
    if hint is int:
        return _integer(value, key)
    if hint is float:
        if isinstance(value, bool) or isinstance(value, str) and not (
                _DECIMAL_FLOAT.fullmatch(value.strip()) or value.strip().lstrip("+-").lower() in _NONFINITE):
            raise _wrong(key, "a number", value)  # 0x1p-3, 1_0.5: Python reads them, YAML 1.2 does not
        try:
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise _wrong(key, "a number", value) from None
        if not math.isfinite(number):  # nan compares false with every bound a later check makes
            raise ConfigError(f"must be a finite number, got {value!r}", key=key)
        return number
    if hint is str:
        if isinstance(value, (dict, list)):
            raise _wrong(key, "a string", value)
        if isinstance(value, bool):
            return "true" if value else "false"
        return str(value)
    if hint is Any:  # options a plug-in checks itself: plain scalars, or a list of them
        scalar = (str, int, float, bool)
        if isinstance(value, scalar) or isinstance(value, list) and all(isinstance(v, scalar) for v in value):
            return value
        raise _wrong(key, "a string, number, true/false or a list of them", value)
    raise TypeError(f"schema type {hint!r} at {key} is not supported")


def _integer(value: Any, key: str) -> int:
    """An int field's value: an int, an integral float (1.0e+3), or the text of a plain decimal integer. Text that
    readers disagree on (010: 8 in YAML 1.1, 10 in YAML 1.2; 0x10, 1_000, 1:30) is refused with the decimal to write,
    the same from a file and from an override; so are values no 64-bit integer holds."""
    if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
        raise _wrong(key, "an integer", value)
    if isinstance(value, str):
        text = value.strip()
        if _DECIMAL_INT.fullmatch(text) and len(text.lstrip("+-")) > 19:
            raise ConfigError(f"{_short(text)} does not fit a 64-bit integer", key=key, fix="use a smaller value")
        if not _DECIMAL_INT.fullmatch(text):
            for pattern, what, decimal in _AMBIGUOUS_INTS:
                if pattern.fullmatch(text):
                    try:
                        meant = decimal(text)
                    except ValueError:  # 0x__, 1__0: not even that
                        break
                    raise ConfigError(f"{value!r} {what(text)}", key=key, fix=f"write {meant}")
            if _DECIMAL_FLOAT.fullmatch(text) and float(text).is_integer() and math.isfinite(float(text)):
                raise ConfigError(f"{value!r} is not written as an integer", key=key,
                                  fix=f"write {int(float(text))}")
            raise _wrong(key, "an integer", value)
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        raise _wrong(key, "an integer", value) from None
    if abs(number) > INT64_MAX:
        raise ConfigError(f"{number} does not fit a 64-bit integer", key=key, fix="use a smaller value")
    return number


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """cls(**converted data); missing keys keep their defaults; __post_init__ checks invariants."""
    fields = field_types(cls)
    kwargs = {name: coerce(value, fields[name], f"{prefix}{name}") for name, value in data.items()}
    return cls(**kwargs)
