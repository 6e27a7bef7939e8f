"""Credentials stay out of recipes, run folders and MLflow, and masking hides nothing else.

- A value holding a URI with a credential (`http://user:password@mlflow:5000`, `s3://bucket/x?X-Amz-Signature=...`,
  `https://ghp_...@github.com/...`) is refused when the recipe is loaded, naming the key, its layer and where the
  credential belongs instead (MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, or any variable, listed in the
  site profile's `site.secrets`: jobs inherit them from the environment `submit` runs in). Masking it in
  resolved.yaml instead would hand every job a URI that no longer authenticates. The error itself shows the value
  masked (`embodyhpc.errors.mask_credentials`, which every one-line error goes through).
- Masking by name is for names a user invents: the variables of `site.env` and `network.extra_env` (HF_TOKEN; load
  refuses those too, this is for files written before it did) and keys outside the schema. A schema field is an
  ordinary setting whatever its name ends in: `model.state_key` is a dataset feature, not an API key, and the
  resolved.yaml MLflow keeps must load and run again as it is.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from embodyhpc.config.guards import flatten, looks_secret
from embodyhpc.errors import MASK, ConfigError, mask_credentials, secret_param, uri_userinfo

ENV_SECTIONS = ("site.env", "network.extra_env")
"""Mappings whose keys are environment variable names, which say whether their value is a secret (HF_TOKEN)."""
_SCHEME = re.compile(r"\b[A-Za-z][A-Za-z0-9+.\-]*://")
_QUERY = re.compile(r"[?&;]([A-Za-z0-9_.\-]+)=([^&;#\s]*)")


def uri_credential(text: str) -> str | None:
    """What credential a URI inside `text` carries (mask_credentials would hide it), None when it carries none.
    Only URIs count: `comment: a;key=1` is no query string."""
    for match in _SCHEME.finditer(text):
        rest = text[match.end():]
        found = uri_userinfo(rest)
        if found is not None:
            return "a password" if found[0] > 0 else "an access token as its user name"
        for param in _QUERY.finditer(rest.split(maxsplit=1)[0] if rest.strip() else ""):
            if param[2] and secret_param(param[1]):
                return f"a credential in its query ({param[1]}=)"
    return None


def without_credentials(text: str) -> str:
    """`text` with the credentials of its URIs removed (user:password@ and secret query parameters dropped)."""
    masked = mask_credentials(text).replace(f"://{MASK}@", "://")
    masked = re.sub(rf"://[^\s'\"/@]*:{re.escape(MASK)}@", "://", masked)
    masked = re.sub(rf"[&;][\w.\-]+={re.escape(MASK)}", "", masked)
    masked = re.sub(rf"\?[\w.\-]+={re.escape(MASK)}[&;]?", "?", masked)
    return re.sub(r"\?(?=#|\s|$)", "", masked)


def _fix(key: str, clean: str) -> str:
    if key == "tracking.mlflow_uri":
        return (f"set {key}={clean} and list MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
                "MLFLOW_TRACKING_TOKEN) in site.secrets of the site profile: jobs inherit them from the environment "
                "you submit from, and no file holds them")
    if key.startswith("site.container."):
        return (f"set {key}={clean}: enroot reads registry credentials from its own credentials file "
                "($ENROOT_CONFIG_PATH/.credentials)")
    return (f"set {key}={clean} and pass the credential as an environment variable listed in site.secrets of the "
            "site profile (e.g. AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY for s3://)")


def check_values(combined: Mapping[str, Any], where_of: Callable[[str], str | None],
                 skip: Callable[[str], bool] = lambda key: False) -> None:
    """Refuse the first string value (or list item) of the merged recipe that holds a URI with a credential.
    `where_of(key)` names the layer that set it; `skip(key)`: values not to check (a run's own resolved.yaml)."""
    for key, value in flatten(dict(combined)).items():
        if skip(key):
            continue
        for item in value if isinstance(value, list) else [value]:
            found = uri_credential(item) if isinstance(item, str) else None
            if found is not None:
                raise ConfigError(f"{mask_credentials(item)!r} carries {found}, which resolved.yaml, run.json, the "
                                  "job scripts and MLflow would hold", where=where_of(key), key=key,
                                  fix=_fix(key, without_credentials(item)))


def secret_key(dotted: str) -> bool:
    """Whether the value under a dotted key is a secret by its name alone: a variable of site.env or
    network.extra_env whose name looks secret (HF_TOKEN), or a secret-looking key outside the recipe schema. Schema
    fields (model.state_key, model.max_token_len) and the option names of plug-ins, suites and sbatch are ordinary
    settings whatever their names end in."""
    for section in ENV_SECTIONS:
        if dotted.startswith(section + "."):
            return looks_secret(dotted[len(section) + 1:])
    return not _in_schema(dotted) and looks_secret(dotted.rsplit(".", 1)[-1])


def _in_schema(dotted: str) -> bool:
    from embodyhpc.config.coerce import field_types
    from embodyhpc.config.schema import Config

    cls: Any = Config
    for part in dotted.split("."):
        fields = field_types(cls)
        if part not in fields:
            return False
        hint = fields[part]
        if typing.get_origin(hint) in (typing.Union, types.UnionType):  # Optional[Section]
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        if not dataclasses.is_dataclass(hint):
            return True  # a field, or a name inside one of the schema's own mappings (options, extra_sbatch)
        cls = hint
    return True


def redact(data: Any, prefix: str = "") -> Any:
    """A copy of nested mappings/lists with the credentials of the URIs in its strings masked and every value under
    a secret key (secret_key) replaced by ***, whatever its type (a number, the items of a list, the leaves of a
    mapping; booleans and empty values say nothing and stay): what MLflow and the description may show. Nothing
    else changes (text that holds no URI, `comment: a;key=1`, is no query string), so a redacted resolved config
    loads and runs as the original did."""
    if isinstance(data, Mapping):
        out = {}
        for key, value in data.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            out[key] = masked(value) if secret_key(dotted) else redact(value, dotted)
        return out
    if isinstance(data, list | tuple):
        return [redact(item, prefix) for item in data]
    return mask_credentials(data) if isinstance(data, str) and uri_credential(data) else data


def masked(value: Any) -> Any:
    """`value` as a secret key's value is shown: every non-empty leaf *** (booleans and None say nothing)."""
    if isinstance(value, Mapping):
        return {key: masked(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [masked(item) for item in value]
    return value if value is None or isinstance(value, bool) or value == "" else MASK


_NAMED = re.compile(r"([A-Za-z_][\w.\-]*)\s*[:=]")


def redact_override(override: str) -> str:
    """`key=value` as errors, MLflow and run listings show it: the value *** when the key is a secret (secret_key);
    a mapping or list value (`network.extra_env={HF_TOKEN: ...}`) with its secret keys' values *** (as JSON); else
    with its URI credentials masked (text that holds no URI is left as written). A value that does not parse and
    names a secret-looking key is *** whole."""
    key, sep, value = override.partition("=")
    if not sep or not value:
        return _uri_masked(override)
    if secret_key(key):
        return f"{key}={MASK}"
    if value.lstrip()[:1] in ("{", "["):
        from embodyhpc.config.yamlio import load_yaml

        try:
            parsed = load_yaml(value)
        except Exception:  # noqa: BLE001 - unparseable: judged by the names it holds
            if any(secret_key(f"{key}.{name}") for name in _NAMED.findall(value)):
                return f"{key}={MASK}"
            return _uri_masked(override)
        if isinstance(parsed, Mapping | list) and _holds_secret(parsed, key):
            return f"{key}={json.dumps(redact(parsed, key), default=str)}"
    return _uri_masked(override)


def _uri_masked(text: str) -> str:
    return mask_credentials(text) if uri_credential(text) else text


def _holds_secret(data: Any, prefix: str) -> bool:
    if isinstance(data, Mapping):
        return any(secret_key(f"{prefix}.{k}") and masked(v) != v or _holds_secret(v, f"{prefix}.{k}")
                   for k, v in data.items())
    if isinstance(data, list):
        return any(_holds_secret(item, prefix) for item in data)
    return False
