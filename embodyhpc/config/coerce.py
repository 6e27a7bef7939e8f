"""Build the schema dataclasses from merged plain data, checking and converting types.

Conversions follow OmegaConf's structured-config rules for the types the schema uses (int,
float, bool, str, Optional, List, Dict, nested dataclasses) so recipes behave the same; doing
it here keeps `embodyhpc render` off OmegaConf's import and node machinery (CLI latency).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, Union

from embodyhpc.errors import ConfigError

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _wrong(key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"wrong type: expected {expected}, got {value!r}", key=key)


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
        if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
            raise _wrong(key, "an integer", value)
        try:
            return int(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            raise _wrong(key, "an integer", value) from None
    if hint is float:
        if isinstance(value, bool):
            raise _wrong(key, "a number", value)
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


def build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """cls(**converted data); missing keys keep their defaults; __post_init__ checks invariants."""
    fields = field_types(cls)
    kwargs = {name: coerce(value, fields[name], f"{prefix}{name}") for name, value in data.items()}
    return cls(**kwargs)
