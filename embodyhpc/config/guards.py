"""Checks on the recipe layers before they are merged: who may set what, and what interpolation may cost.

- Keys that choose what code runs on the cluster (the python, the templates, the container, modules, secrets, and
  job environment variables that load code: LD_PRELOAD, PYTHONPATH, BASH_ENV ...) come only from a site
  profile: a shared recipe or a `key=value` pasted from a chat must not be able to run code when someone previews
  or submits it.
- Secrets never enter the recipe: `${oc.env:HF_TOKEN}` would write the token into resolved.yaml, the MLflow
  params and the sbatch scripts. A site profile lists them in `site.secrets`; jobs inherit them from the
  submitting environment (sbatch exports it), and nothing embodyhpc writes holds them.
- `${...}` interpolation copies values: nine references to a key holding nine references... is a bomb of its own
  that the YAML alias cap cannot see. Its expanded size is bounded before OmegaConf resolves anything.
"""

from __future__ import annotations

import re
from typing import Any

from embodyhpc.errors import ConfigError

# prefixes of dotted keys only a site profile may set
SITE_ONLY_KEYS = ("site.python", "site.templates_dir", "site.container", "site.modules", "site.secrets")
# environment variables that choose what code a job loads (the dynamic loader, Python, the shell, plugins, caches of
# compiled kernels): in site.env and network.extra_env only a site profile may set them; a recipe may tune the rest
_CODE_ENV = re.compile(r"^(LD_\w+|PYTHON\w*|PATH|BASH_ENV|ENV|PROMPT_COMMAND|SHELLOPTS|BASHOPTS|IFS|"
                       r"NCCL_\w*PLUGIN\w*|CUDA_INJECTION\w*|ENROOT_\w+|PYXIS_\w+|SUBMITIT_\w+|MUJOCO_PLUGIN\w*|"
                       r"TORCHINDUCTOR_\w+|TRITON_\w+|TORCH_EXTENSIONS_DIR|HF_MODULES_CACHE|EMBODYHPC_\w+)$")
_ENV_SECTIONS = ("site.env.", "network.extra_env.")
# anywhere in a name: a secret; as its last word only (max_token_len is a length, HF_TOKEN a token)
_SECRET_WORDS = ("secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials", "apikey")
_SECRET_LAST_WORDS = ("token", "key", "auth", "pwd", "cookie", "pat")
MAX_INTERPOLATED = 1_000_000  # characters + values after every ${...} is expanded
_REF = re.compile(r"\$\{([A-Za-z_][\w.\[\]-]*)\}")  # a plain ${a.b.c} reference (not a resolver call)
_ENV_COMPUTED = re.compile(r"oc\.env\s*:\s*['\"]?\$\{")
_ENV_READ = re.compile(r"oc\.env\s*:\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)")


def looks_secret(name: str) -> bool:
    """HF_TOKEN, WANDB_API_KEY, aws_secret_access_key, db.password, apiKey ...: split on _ . - and camel case."""
    words = [w.lower() for w in re.split(r"[_.\-\s]+|(?<=[a-z])(?=[A-Z])", str(name)) if w]
    return bool(words) and (any(w in _SECRET_WORDS for w in words) or words[-1] in _SECRET_LAST_WORDS)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value} of nested mappings (an empty mapping is a leaf)."""
    if isinstance(data, dict) and data:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): data}


def strip_site_only(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of a layer without the keys only a site profile may set (a resolved config someone handed over)."""
    def keep(prefix: str, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        out = {}
        for k, v in value.items():
            key = f"{prefix}{k}"
            section = next((p for p in _ENV_SECTIONS if key.startswith(p)), None)
            if any(key == p or key.startswith(p + ".") for p in SITE_ONLY_KEYS) or (
                    section is not None and _CODE_ENV.match(key[len(section):])):
                continue
            out[k] = keep(f"{key}.", v)
        return out

    return keep("", data)


def check_layer(data: dict[str, Any], where: str, *, is_site: bool) -> None:
    """Refuse site-only keys outside a site profile, and secrets read into the recipe from the environment."""
    for key, value in flatten(data).items():
        if not is_site and value not in (None, "", [], {}):
            only = next((p for p in SITE_ONLY_KEYS if key == p or key.startswith(p + ".")), None)
            section = next((p for p in _ENV_SECTIONS if key.startswith(p)), None)
            if only is None and section is not None and _CODE_ENV.match(key[len(section):]):
                only = key
            if only is not None:
                raise ConfigError(f"{only} chooses what code runs on the cluster: only a site profile may set it",
                                  where=where, key=key, fix=f"move {only} into a site profile (--site FILE)")
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and _ENV_COMPUTED.search(text):
                raise ConfigError("reads an environment variable whose name is itself interpolated, so no check can "
                                  "tell whether it is a secret", where=where, key=key,
                                  fix="name the variable literally, e.g. ${oc.env:MY_VAR}")
            match = _ENV_READ.search(text) if isinstance(text, str) else None
            if match and looks_secret(match.group(1)):
                name = match.group(1)
                raise ConfigError(f"reads the secret-looking variable {name} into the recipe, which is written to "
                                  "resolved.yaml, MLflow and the scripts", where=where, key=key,
                                  fix=f"list {name} in site.secrets of the site profile: jobs inherit it from "
                                      "your environment and no file holds it")


def check_interpolation_size(combined: dict[str, Any], where_of: Any) -> None:
    """Bound what `${...}` expands to before OmegaConf resolves it. `where_of(key)` names the layer."""
    flat = flatten(combined)
    memo: dict[str, int] = {}
    active: set[str] = set()

    def node(path: str) -> Any:
        value: Any = combined
        for part in path.split("."):
            if not isinstance(value, dict) or part not in value:
                return None
            value = value[part]
        return value

    def size(value: Any, path: str | None) -> int:
        if path is not None:
            if path in memo:
                return memo[path]
            if path in active:  # a cycle: OmegaConf reports it
                return 0
            active.add(path)
        if isinstance(value, dict):
            total = 1 + sum(size(v, f"{path}.{k}" if path is not None else None) for k, v in value.items())
        elif isinstance(value, list):
            total = 1 + sum(size(v, None) for v in value)
        elif isinstance(value, str) and "${" in value:
            total = len(value) + sum(size(node(ref), ref) for ref in _REF.findall(value))
        else:
            total = 1 + (len(value) if isinstance(value, str) else 0)
        if path is not None:
            active.discard(path)
            memo[path] = total
        if total > MAX_INTERPOLATED:
            raise _TooBig(path)
        return total

    for key, value in flat.items():
        if isinstance(value, str) and "${" in value:
            try:
                size(value, key)
            except _TooBig as exc:
                blamed = exc.path or key
                raise ConfigError(f"${{...}} interpolation here expands to more than {MAX_INTERPOLATED} "
                                  "characters (references of references: a bomb?)", where=where_of(blamed),
                                  key=blamed, fix="reference scalar values, not whole sections") from None


class _TooBig(Exception):
    def __init__(self, path: str | None) -> None:
        super().__init__(path)
        self.path = path
