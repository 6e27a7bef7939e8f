"""Read a recipe: schema defaults <- base recipes <- recipe <- site profile <- key=value overrides.

Every layer is checked against the schema before it is merged, so an error names the layer
(file or override), the dotted key and the fix. Nothing here imports torch. What only the registries (models,
suites) and datasets know is checked one step above, by embodyhpc/validation, whose load_recipe,
load_unresolved, load_config_file and load_resolved every command uses: merge_recipe and read_config_file
here are their first half.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from embodyhpc.config import credentials, guards
from embodyhpc.config.coerce import build, field_types
from embodyhpc.config.resolve import Resolved, resolve
from embodyhpc.config.schema import SITE_KEYS, Config, JobConfig
from embodyhpc.config.yamlio import MAX_BYTES, YAMLLimitError
from embodyhpc.config.yamlio import load_yaml as _yaml_load
from embodyhpc.errors import ConfigError

SITE_ENV_VAR = "EMBODYHPC_SITE"
_MAX_BASE_DEPTH = 16


@dataclass(frozen=True)
class Source:
    """A YAML document: a file on disk or one shipped inside the package."""

    name: str  # what errors call it
    text: str
    folder: Path | None  # for resolving `base:` relative to it; None for shipped files


@dataclass(frozen=True)
class Layer:
    where: str
    data: dict[str, Any]
    keys: tuple[str, ...] = ()  # keys it sets as a whole (an override's key, even when its value is a mapping)


@dataclass(frozen=True)
class LoadedRecipe:
    config: Config
    resolved: Resolved
    recipe: str
    site: str | None
    overrides: tuple[str, ...]
    provenance: dict[str, str]  # dotted key -> the layer that set it last

    def to_yaml(self) -> str:
        return dump_yaml(self.config)


def dump_yaml(config: Config) -> str:
    return yaml.safe_dump(config_data(config), sort_keys=False, default_flow_style=False)


def config_data(config: Config) -> dict[str, Any]:
    """The config as plain data under its recipe keys (what resolved.yaml and MLflow's params hold)."""
    return _renamed(dataclasses.asdict(config), Config, to_fields=False)


# ---------------------------------------------------------------- recipe keys and field names

def recipe_key(name: str) -> str:
    """A schema field's key in a recipe: the field `async_` is the key `async` (a Python keyword cannot name a
    field); every other field is its own key. Applied to each part of a dotted key."""
    return ".".join(part[:-1] if part.endswith("_") and keyword.iskeyword(part[:-1]) else part
                    for part in name.split("."))


def recipe_fields(cls: type) -> dict[str, Any]:
    """A schema dataclass's fields under their recipe keys."""
    return {recipe_key(name): hint for name, hint in field_types(cls).items()}


def _renamed(data: dict[str, Any], cls: type, *, to_fields: bool) -> dict[str, Any]:
    """`data` with the keys of `cls`'s fields (nested sections too) renamed from recipe keys to field names
    (to_fields) or back; keys inside the schema's own mappings (site.env, model.options) stay as they are."""
    fields = field_types(cls)
    by_key = {recipe_key(name): name for name in fields}
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = by_key.get(key) if to_fields else key if key in fields else None
        if name is None:
            out[key] = value
            continue
        hint = fields[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = _renamed(value, hint, to_fields=to_fields)
        out[name if to_fields else recipe_key(name)] = value
    return out


def _in_recipe_keys(exc: ConfigError) -> ConfigError:
    """An error of the schema's (whose keys are field names) in the recipe's keys."""
    key = recipe_key(exc.key) if exc.key else exc.key
    related = tuple(recipe_key(k) for k in exc.related)
    if key == exc.key and related == tuple(exc.related):
        return exc
    return ConfigError(exc.message, where=exc.where, key=key, related=related, fix=exc.fix)



# ---------------------------------------------------------------- finding files

def shipped_recipes() -> list[str]:
    root = resources.files("embodyhpc.recipes")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def shipped_sites() -> list[str]:
    root = resources.files("embodyhpc.recipes").joinpath("sites")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def _read_shipped(*parts: str) -> Source | None:
    node = resources.files("embodyhpc.recipes")
    for part in parts:
        node = node.joinpath(part)
    if not node.is_file():
        return None
    return Source(name=f"embodyhpc:{'/'.join(parts)}", text=node.read_text(), folder=None)


def _read_path(path: Path) -> Source:
    """At most MAX_BYTES + 1 bytes are read (a recipe pointing at a huge file or a device stays cheap); the
    content is never echoed in an error (`base: /etc/shadow` must not print the file)."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", where=str(path)) from exc
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"larger than {MAX_BYTES >> 10} KiB: not a recipe", where=str(path),
                          fix="recipes are small YAML files; check the path")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start}): not a recipe", where=str(path),
                          fix="save the file as UTF-8, or check the path") from exc
    return Source(name=str(path), text=text, folder=path.parent)


def find_recipe(ref: str, *, relative_to: Path | None = None, shipped_only: bool = False,
                subdir: str | None = None) -> Source:
    """A file path (relative to `relative_to`, else the cwd), else a shipped name like `pi05_fp8`."""
    if not shipped_only:
        path = relative_to / ref if relative_to is not None else Path(ref)
        if path.is_file():
            return _read_path(path)
    kind, listing = ("site profile", shipped_sites()) if subdir else ("recipe", shipped_recipes())
    if "/" not in ref:
        name = ref if ref.endswith(".yaml") else f"{ref}.yaml"
        shipped = _read_shipped(*([subdir] if subdir else []), name)
        if shipped is not None:
            return shipped
    hint = difflib.get_close_matches(Path(ref).stem, listing, n=1)
    fix = f"did you mean {hint[0]!r}?" if hint else f"shipped {kind}s: {', '.join(listing)}"
    raise ConfigError(f"{kind} not found", where=ref, fix=fix)


def _parse(source: Source, *, allow_empty: bool = False) -> dict[str, Any]:
    try:
        data = _yaml_load(source.text)
    except YAMLLimitError as exc:
        line = f"line {exc.line}" if exc.line else None
        raise ConfigError(f"refused: {exc.problem}", where=source.name, key=line) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f"line {mark.line + 1}" if mark is not None else None
        problem = getattr(exc, "problem", None) or "control characters or not a YAML document"
        # PyYAML quotes what it found ('...'): that is the file's content, which an error must not echo
        problem = re.sub(r"'[^']*'|\"[^\"]*\"", "...", problem)
        raise ConfigError(f"invalid YAML: {problem}", where=source.name, key=line) from exc
    except RecursionError as exc:
        raise ConfigError("refused: nested too deeply", where=source.name) from exc
    if data is None:
        if allow_empty:
            return {}
        raise ConfigError("the file is empty (no settings at all)", where=source.name,
                          fix="write the recipe's sections, or remove the file from the command")
    if not isinstance(data, dict):
        raise ConfigError(f"top level must be a mapping of sections, got {type(data).__name__}",
                          where=source.name)
    known = set(recipe_fields(Config)) | {"base"}
    if data and not any(isinstance(key, str) and difflib.get_close_matches(key, known, n=1, cutoff=0.75)
                        for key in data):
        # no recipe section at all: not a recipe; naming its keys could disclose the file
        raise ConfigError(f"not a recipe: none of its top-level keys is a section ({', '.join(sorted(known))})",
                          where=source.name, fix="check the path")
    return data


# ---------------------------------------------------------------- schema checks

def _check_keys(data: dict[str, Any], cls: type, prefix: str, where: str) -> None:
    """Reject keys the schema does not know, with a suggestion."""
    fields = recipe_fields(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if not isinstance(key, str):
            raise ConfigError(f"key {key!r} is not a string", where=where, key=prefix.rstrip(".") or None)
        if key not in fields:
            close = [f for f in fields if f.startswith(key) or key.startswith(f)] or \
                difflib.get_close_matches(key, list(fields), n=1, cutoff=0.5)
            fix = f"did you mean {prefix}{close[0]}?" if close else \
                f"valid keys under {prefix.rstrip('.') or 'the top level'}: {', '.join(fields)}"
            raise ConfigError("unknown key", where=where, key=dotted, fix=fix)
        hint = fields[key]
        if dataclasses.is_dataclass(hint):
            if value is None:
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"must be a mapping, got {type(value).__name__}", where=where, key=dotted)
            _check_keys(value, hint, f"{dotted}.", where)


def _check_site_keys(data: dict[str, Any], where: str) -> None:
    for key in guards.flatten(data):
        if not any(key == allowed or key.startswith(allowed + ".") for allowed in SITE_KEYS):
            raise ConfigError("a site profile may only set cluster keys", where=where, key=key,
                              fix=f"move it to the recipe; site keys: {', '.join(SITE_KEYS)}")


def _check_text(combined: dict[str, Any], provenance: dict[str, str]) -> None:
    """Recipe text reaches sbatch scripts: no newlines or control characters anywhere."""
    for key, value in guards.flatten(combined).items():
        values = value if isinstance(value, list) else [value]
        for item in values:
            if isinstance(item, str) and any(ord(c) < 32 or ord(c) == 127 for c in item):
                raise ConfigError(f"contains a newline or control character: {item!r}",
                                  where=_where(key, provenance), key=key, fix="write it on one line")


# ---------------------------------------------------------------- layers

def _recipe_layers(source: Source) -> list[Layer]:
    """The recipe and the chain of base recipes it names, base first."""
    chain: list[Layer] = []
    seen: list[str] = []
    current: Source | None = source
    while current is not None:
        if current.name in seen:
            raise ConfigError(f"base recipes form a cycle: {' -> '.join([*seen, current.name])}",
                              where=current.name, key="base")
        if len(seen) >= _MAX_BASE_DEPTH:
            raise ConfigError("base recipe chain is too deep", where=current.name, key="base")
        seen.append(current.name)
        data = _parse(current)
        base = data.pop("base", None)
        chain.append(Layer(current.name, data))
        if base is None:
            current = None
        elif not isinstance(base, str) or not base:
            raise ConfigError(f"must name a recipe file, got {base!r}", where=current.name, key="base")
        else:
            try:
                current = find_recipe(base, relative_to=current.folder, shipped_only=current.folder is None)
            except ConfigError as exc:
                raise ConfigError(f"base recipe {base!r} not found", where=current.name, key="base",
                                  fix=exc.fix) from exc
    return list(reversed(chain))


def _short(text: str, limit: int = 100) -> str:
    """A long value in an error message: its start, and how long it is."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _override_layer(text: str) -> Layer:
    where = f"override {_short(credentials.redact_override(text))!r}"  # site.env.HF_TOKEN=... is refused, not shown
    key, sep, _ = text.partition("=")
    if not sep or not key or key != key.strip() or any(not part for part in key.split(".")):
        raise ConfigError("overrides are key=value with a dotted key", where=where,
                          fix="e.g. train.steps=100 or resources.nodes=2")
    raw = text.partition("=")[2]
    try:
        value = _yaml_load(raw) if raw.strip() else ""
    except YAMLLimitError as exc:
        raise ConfigError(f"refused: {exc.problem}", where=where, key=key) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"cannot parse the value {_short(raw)!r} as YAML", where=where, key=key,
                          fix="quote it, e.g. key='a: b'") from exc
    return Layer(where, _nested(key, value), keys=(key,))


def _nested(key: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for the dotted key "a.b"."""
    data: dict[str, Any] = {}
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


def _site_source(site: str | None) -> Source | None:
    ref = site or os.environ.get(SITE_ENV_VAR) or None
    if ref is None:
        return None
    return find_recipe(ref, subdir="sites")


def site_runs_root(site: str | None) -> str:
    """The runs root a site profile sets (`site`, else $EMBODYHPC_SITE), else the schema's default: where
    `embodyhpc runs` looks and RUN names resolve. The profile is parsed and checked as `submit` would."""
    source = _site_source(site)
    data = _parse(source) if source is not None else {}
    if source is not None:
        _check_site_keys(data, source.name)
        guards.check_layer(data, source.name, is_site=True)
    value = (data.get("job") or {}).get("runs_root") if isinstance(data.get("job"), dict) else None
    if value is None:
        return JobConfig().runs_root
    try:  # the checks submit makes (a string, no '%', not too long)
        build(JobConfig, {"runs_root": value}, "job.")
    except ConfigError as exc:
        raise ConfigError(exc.message, where=source.name if source else None, key=exc.key, fix=exc.fix) from exc
    return str(value)


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "msg", None) or exc)
    return text.strip().splitlines()[0] if text.strip() else type(exc).__name__


def _where(key: str, provenance: dict[str, str]) -> str:
    key = re.sub(r"\[\d+\]", "", key)  # eval.seeds[0] was set with eval.seeds
    while key:
        if key in provenance:
            return provenance[key]
        key = key.rpartition(".")[0]
    return "schema defaults"


def _deep_merge(into: dict[str, Any], layer: dict[str, Any]) -> None:
    for key, value in layer.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


UNREAD = "unset-not-read-by-this-command"
"""The value load_recipe(unread=...) gives a `???` key the command never reads."""


def _merge(layers: list[Layer]) -> tuple[dict[str, Any], dict[str, str], set[str]]:
    """Merge the layers as plain data; provenance says which layer set each key last, so any
    later error names its layer. Also returns the keys left `???` (the user must supply them)."""
    provenance: dict[str, str] = {}
    combined: dict[str, Any] = {}
    for layer in layers:
        _check_keys(layer.data, Config, "", layer.where)
        _deep_merge(combined, layer.data)
        for key in (*guards.flatten(layer.data), *layer.keys):
            provenance.pop(key, None)  # re-inserted: the dict's order is the order of the layers (see located)
            provenance[key] = layer.where
    missing = {key for key, value in guards.flatten(combined).items() if value == "???"}
    if any(isinstance(v, str) and "${" in v for v in guards.flatten(combined).values()):
        guards.check_interpolation_size(combined, lambda key: _where(key, provenance))
        combined = _interpolate(combined, provenance)
    return combined, provenance, missing


def _interpolate(combined: dict[str, Any], provenance: dict[str, str]) -> dict[str, Any]:
    """${key} references and OmegaConf resolvers (e.g. ${oc.env:USER}), resolved by OmegaConf."""
    from omegaconf import OmegaConf
    from omegaconf import errors as oc_errors

    try:
        return OmegaConf.to_container(OmegaConf.create(combined), resolve=True)  # type: ignore[return-value]
    except oc_errors.OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        raise ConfigError(f"interpolation failed: {_first_line(exc)}", where=_where(key, provenance),
                          key=key or None) from exc


def resolve_located(config: Config, provenance: dict[str, str]) -> Resolved:
    """resolve(config), its errors naming the layer that set the keys involved."""
    try:
        return resolve(config)
    except ConfigError as exc:
        raise located(exc, provenance) from exc


def merge_recipe(recipe: str, overrides: list[str] | tuple[str, ...] = (), site: str | None = None,
                 *, recipe_site_keys: str = "refuse",
                 unread: tuple[str, ...] = ()) -> tuple[Config, dict[str, str], str, str | None]:
    """The layers merged and built: (config, provenance, recipe name, site profile name). Every section's own checks
    run; the registries' (embodyhpc/validation) and what depends on the world size (resolve) do not.

    recipe_site_keys: what to do with keys only a site profile may set (guards.SITE_ONLY_KEYS) when the recipe
    file sets them: "refuse" (a recipe), "drop" (a resolved config from someone's export: the site profile
    given now decides) or "keep" (the resolved.yaml submit wrote into a run directory, reloaded by its jobs).
    unread: keys the calling command never reads (`smoke` reads no data): one the recipe leaves `???` gets the
    placeholder UNREAD instead of a missing-value error."""
    source = find_recipe(recipe)
    layers = _recipe_layers(source)
    frozen = {layer.where for layer in layers} if recipe_site_keys == "keep" else set()
    if recipe_site_keys == "drop":
        layers = [Layer(layer.where, guards.strip_site_only(layer.data), layer.keys) for layer in layers]
    for layer in layers:
        guards.check_layer(layer.data, layer.where, is_site=recipe_site_keys == "keep")
    site_source = _site_source(site)
    if site_source is not None:
        site_data = _parse(site_source)
        _check_site_keys(site_data, site_source.name)
        guards.check_layer(site_data, site_source.name, is_site=True)
        layers.append(Layer(site_source.name, site_data))
    for text in overrides:
        layer = _override_layer(text)
        guards.check_layer(layer.data, layer.where, is_site=False)
        layers.append(layer)

    combined, provenance, missing_keys = _merge(layers)
    for key in missing_keys & set(unread):
        _deep_merge(combined, _nested(key, UNREAD))
    missing = sorted(missing_keys - set(unread))
    if missing:
        key = missing[0]
        raise ConfigError("missing value (??? in the recipe)", where=_where(key, provenance), key=key,
                          fix=f"set it, e.g. {key}=..." + (f" (also missing: {', '.join(missing[1:])})"
                                                           if len(missing) > 1 else ""))
    try:
        _check_text(combined, provenance)
        # a run's own resolved.yaml (resume) is what its jobs already read: only what changes now is checked
        credentials.check_values(combined, lambda key: _where(key, provenance),
                                 skip=lambda key: _where(key, provenance) in frozen)
        config = build(Config, _renamed(combined, Config, to_fields=True))
    except ConfigError as exc:
        raise located(_in_recipe_keys(exc), provenance) from exc
    assert isinstance(config, Config)
    return config, provenance, source.name, site_source.name if site_source else None


def located(exc: ConfigError, provenance: dict[str, str]) -> ConfigError:
    """Name the layer that last set one of the keys involved (a later layer wins a conflict)."""
    if exc.where is not None:
        return exc
    order = list(dict.fromkeys(provenance.values()))
    involved = [_where(k, provenance) for k in (exc.key or "", *exc.related)]
    if all(w not in order for w in involved) and exc.key:  # only defaults involved: who set the section?
        section = exc.key.split(".")[0]
        involved = [w for k, w in provenance.items() if k.split(".")[0] == section] or involved
    where = max(involved, key=lambda w: order.index(w) if w in order else -1)
    return ConfigError(exc.message, where=where, key=exc.key, fix=exc.fix)


def read_config_file(path: str | Path, check: Callable[[Config], object] | None = None) -> Config:
    """A resolved config written by submit or by an export (config.yaml next to the weights), its sections' own
    checks run, then `check` (the registries': embodyhpc/validation's validate, or a library's check of the one
    section it reads), every error naming the file."""
    path = Path(path)
    data = _parse(_read_path(path))
    _check_keys(data, Config, "", str(path))
    try:
        config = build(Config, _renamed(data, Config, to_fields=True))
        if check is not None:
            check(config)
    except ConfigError as exc:
        exc = _in_recipe_keys(exc)
        raise ConfigError(exc.message, where=str(path), key=exc.key, fix=exc.fix) from exc
    return config
