"""Names and values MLflow accepts: metric keys, truncated strings, flattened params, finite metrics, tags.

Pure functions (no mlflow import): every module of embodyhpc.tracking passes what it logs through these.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from typing import Any

from embodyhpc.config.credentials import masked, redact, redact_override, secret_key  # noqa: F401 - submit names them here
from embodyhpc.errors import mask_credentials

NONFINITE_METRIC = "nonfinite_metrics"
"""Metric counting the values skipped at a step because they were NaN/inf or not numbers."""

# MLflow's limits (mlflow.utils.validation): keys, param and tag values, entities per log_batch call.
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000

_KEY_BAD_CHARS = re.compile(r"[^/\w.\- :]")


def metric_key(key: str) -> str:
    """A key MLflow accepts: characters outside [A-Za-z0-9_-. :/] become '_', no empty or relative path parts."""
    cleaned = _KEY_BAD_CHARS.sub("_", str(key))
    parts = [part for part in cleaned.split("/") if part not in ("", ".", "..")]
    return ("/".join(parts) or "_")[:MAX_KEY_LENGTH]


def truncate(value: str, limit: int) -> str:
    """`value` cut to `limit` characters, ending with a marker that says how much was cut."""
    if len(value) <= limit:
        return value
    def marker(cut: int) -> str:
        return f"...[truncated {len(value) - cut} chars]"

    cut = limit - len(marker(0))  # the longest marker: the result fits
    while cut + 1 + len(marker(cut + 1)) <= limit:  # fewer digits may leave room: fill to exactly `limit`
        cut += 1
    return value[:cut] + marker(cut)


REDACTED = "***"


def flatten_params(params: Mapping[str, Any] | Any, *, prefix: str = "") -> dict[str, str]:
    """Nested mappings (and dataclasses) to dotted keys; lists as compact JSON; values cut to MLflow's limit.
    Anyone who can open the UI reads params: a secret key's value (config.credentials.secret_key: HF_TOKEN in
    site.env, not model.state_key) is ***, and URI credentials are masked."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        params = dataclasses.asdict(params)
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            value = dataclasses.asdict(value)
        if secret_key(name) and masked(value) != value:  # whatever its type: a number, a list, a mapping
            text = REDACTED
        elif isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=name))
            continue
        elif isinstance(value, list | tuple | Mapping):
            text = mask_credentials(json.dumps(value, default=str, separators=(",", ":")))
        else:
            text = mask_credentials(str(value))
        flat[metric_key(name)] = truncate(text, MAX_PARAM_VALUE_LENGTH)
    return flat


def finite_metrics(metrics: Mapping[str, Any]) -> tuple[dict[str, float], int]:
    """(the finite numeric values under MLflow-safe keys, how many values were skipped)."""
    kept: dict[str, float] = {}
    skipped = 0
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            skipped += 1
            continue
        if math.isfinite(number):
            kept[metric_key(key)] = number
        else:
            skipped += 1
    return kept, skipped


def tags_of(tags: Mapping[str, Any] | None) -> dict[str, str]:
    return {metric_key(k): truncate(mask_credentials(str(v)), MAX_TAG_VALUE_LENGTH) for k, v in (tags or {}).items()}


def one_line(exc: BaseException) -> str:
    """An exception on one line, at most 300 characters, its URI credentials masked (MLflow's REST errors quote the
    request URL, user:password included)."""
    text = mask_credentials(" ".join(str(exc).split())) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."

