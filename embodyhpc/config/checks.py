"""Small validators shared by the schema dataclasses.

Each raises ConfigError naming the dotted key; the loader adds which file or override set it.
"""

from __future__ import annotations

import re

from embodyhpc.errors import ConfigError

_MEM_RE = re.compile(r"^[0-9]+[KMGT]?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_OPTION_RE = re.compile(r"^[a-z][a-z0-9-]*$")


def choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{value!r} is not one of {', '.join(choices)}", key=key,
                          fix=f"set {key}={choices[0]} (or another listed value)")


def positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"must be {bound}, got {value}", key=key)


def no_control_chars(key: str, value: str | None) -> None:
    """Recipe text ends up in sbatch scripts: a newline there would start a new shell line."""
    if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigError(f"contains a newline or control character: {value!r}", key=key,
                          fix="write the value on one line")


def slurm_time_minutes(key: str, value: str) -> int:
    """Parse a Slurm time limit into whole minutes (rounded up).

    Accepted, as sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S.
    """
    text = str(value).strip()
    fix = "use Slurm's format, e.g. 90 (minutes), 04:00:00 or 2-00:00:00"
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise ConfigError(f"{value!r} is not a Slurm time limit", key=key, fix=fix)
    days, a, b, c = match.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (nums + [0, 0])[:3]
        total_s = ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
        limits = [(hours, 24), (minutes, 60), (seconds, 60)]
    elif len(nums) == 1:  # M
        total_s, limits = nums[0] * 60, []
    elif len(nums) == 2:  # M:S
        total_s, limits = nums[0] * 60 + nums[1], [(nums[1], 60)]
    else:  # H:M:S
        total_s = (nums[0] * 60 + nums[1]) * 60 + nums[2]
        limits = [(nums[1], 60), (nums[2], 60)]
    if any(part >= bound for part, bound in limits):
        raise ConfigError(f"{value!r} has a field out of range", key=key, fix=fix)
    if total_s <= 0:
        raise ConfigError(f"{value!r} is zero", key=key, fix=fix)
    return -(-total_s // 60)


def slurm_mem(key: str, value: str) -> None:
    if not _MEM_RE.match(str(value)):
        raise ConfigError(f"{value!r} is not a Slurm memory size", key=key,
                          fix="use an integer with an optional unit K, M, G or T, e.g. 64G (0 = all)")


def env_names(key: str, env: dict[str, str]) -> None:
    for name, value in env.items():
        if not _ENV_NAME_RE.match(name):
            raise ConfigError(f"{name!r} is not a valid environment variable name", key=f"{key}.{name}")
        no_control_chars(f"{key}.{name}", str(value))


def sbatch_options(key: str, options: dict[str, str]) -> None:
    for name, value in options.items():
        if not _SBATCH_OPTION_RE.match(name):
            raise ConfigError(f"{name!r} is not an sbatch long option name", key=f"{key}.{name}",
                              fix="use the long option without dashes, e.g. reservation: myres")
        no_control_chars(f"{key}.{name}", str(value))
