"""Small validators shared by the schema dataclasses.

Each raises ConfigError naming the dotted key; the loader adds which file or override set it.
"""

from __future__ import annotations

import math
import os
import re

from embodyhpc.errors import ConfigError

_MEM_RE = re.compile(r"^[0-9]+[KMGT]?$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_OPTION_RE = re.compile(r"^[a-z][a-z0-9-]*$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_NODE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*(\[[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*\])?[A-Za-z0-9_.\-]*$")
MAX_NODE_NAME_LEN = 255
MAX_NAME_LEN = 100  # run folder "<name>-YYYYmmdd-HHMMSS-N" and job names "<name>-train" stay far below 255 bytes
# the deepest file a run writes, below the run folder (submitit's pickles and logs, checkpoint shards, exports)
RUN_DIR_DEPTH_RESERVE = 200
# options embodyhpc renders itself, or that would change how the job is submitted or where its output goes:
# a second #SBATCH line for one of them would silently win over ours. sbatch also accepts unambiguous prefixes
# of long options (--out for --output), so a prefix of one of these is refused too.
RESERVED_SBATCH = ("output", "error", "input", "signal", "array", "open-mode", "job-name", "dependency",
                   "kill-on-invalid-dep", "requeue", "no-requeue", "nodes", "ntasks", "ntasks-per-node",
                   "cpus-per-task", "mem", "mem-per-cpu", "mem-per-gpu", "gres", "gpus", "gpus-per-node",
                   "time", "partition", "account", "qos", "constraint", "exclusive", "chdir", "export",
                   "export-file", "wrap", "parsable", "hold", "wait", "test-only", "get-user-env", "uid", "gid",
                   "propagate", "batch", "exclude")


def choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{value!r} is not one of {', '.join(choices)}", key=key,
                          fix=f"set {key}={choices[0]} (or another listed value)")


def positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    if not math.isfinite(value):
        raise ConfigError(f"must be a finite number, got {value}", key=key)
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"must be {bound}, got {value}", key=key)


def no_control_chars(key: str, value: str | None) -> None:
    """Recipe text ends up in sbatch scripts: a newline there would start a new shell line."""
    if value is not None and any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigError(f"contains a newline or control character: {value!r}", key=key,
                          fix="write the value on one line")


SLURM_TIME_MAX_S = 2**31 - 1
"""Slurm reads a time limit into a 32-bit count of seconds (parse_time.c): past it sbatch misreads it."""


def slurm_time_minutes(key: str, value: str) -> int:
    """Parse a Slurm time limit into whole minutes (rounded up).

    Accepted, as sbatch --time: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S. Refused: UNLIMITED / INFINITE / -1 (sbatch takes
    them, but a job without a limit gets no warning signal before it ends, and the partition's MaxTime applies
    anyway) and limits past Slurm's 32-bit count of seconds.
    """
    text = str(value).strip()
    fix = "use Slurm's format, e.g. 90 (minutes), 04:00:00 or 2-00:00:00"
    if text.lower() in ("unlimited", "infinite", "-1"):
        raise ConfigError(f"{value!r} means no time limit: the job could never be warned (resources.signal_delay_s) "
                          "before the partition's MaxTime ends it", key=key,
                          fix="write the partition's MaxTime (`scontrol show partition`), e.g. 7-00:00:00")
    match = re.fullmatch(r"(?:(\d{1,10})-)?(\d{1,10})(?::(\d{1,10}))?(?::(\d{1,10}))?", text)
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
    if total_s > SLURM_TIME_MAX_S:
        raise ConfigError(f"{value!r} is {total_s} seconds, past the {SLURM_TIME_MAX_S} Slurm can count", key=key,
                          fix="write the partition's MaxTime (`scontrol show partition`), e.g. 7-00:00:00")
    return -(-total_s // 60)


def slurm_mem(key: str, value: str) -> None:
    if not _MEM_RE.match(str(value)):
        raise ConfigError(f"{value!r} is not a Slurm memory size", key=key,
                          fix="use an integer with an optional unit K, M, G or T, e.g. 64G (0 = all)")


def env_names(key: str, env: dict[str, str]) -> None:
    """The variables a mapping exports to jobs (site.env, network.extra_env; site.secrets lists names only): valid
    names, no control characters, and no secret-looking name (secret_variable)."""
    for name, value in env.items():
        if not _ENV_NAME_RE.match(name):
            raise ConfigError(f"{name!r} is not a valid environment variable name", key=f"{key}.{name}")
        no_control_chars(f"{key}.{name}", str(value))
        if key != "site.secrets":
            secret_variable(f"{key}.{name}", name)


def secret_variable(key: str, name: str, how: str | None = None) -> None:
    """Refuse a variable with a secret-looking name (HF_TOKEN, WANDB_API_KEY) given a value in the recipe: the
    value would be written to resolved.yaml, MLflow and the scripts. Every place a recipe hands a job a variable's
    value goes through here (env_names, srun_exports)."""
    from embodyhpc.config.guards import looks_secret

    if looks_secret(name):
        what = f"{how} {name}, which looks" if how else f"{name} looks"
        raise ConfigError(f"{what} like a secret: its value would be written to resolved.yaml, MLflow and the "
                          "scripts", key=key,
                          fix=f"list {name} in site.secrets of the site profile instead: jobs inherit it from your "
                              "environment")


def srun_exports(key: str, args: list[str]) -> None:
    """srun's --export in extra srun arguments (`--export=ALL,NAME=value` or `--export`, `ALL,NAME=value`; srun
    takes an unambiguous start of the option, `--expo=`, too) hands the job NAME=value as site.env does: the same
    secret check (secret_variable). Names alone (`--export=ALL,HF_TOKEN`, pyxis's `--container-env=HF_TOKEN`) pass
    the submitting environment's value on and write none."""
    for index, arg in enumerate(args):
        option, sep, value = str(arg).partition("=")
        if not (len(option) >= len("--exp") and "--export".startswith(option)):
            continue
        if not sep:
            value = str(args[index + 1]) if index + 1 < len(args) else ""
        for item in value.split(","):
            name, assigned, _ = item.partition("=")
            if assigned:
                secret_variable(key, name.strip(), how=f"srun {option} sets")


def sbatch_options(key: str, options: dict[str, str]) -> None:
    for name, value in options.items():
        if not _SBATCH_OPTION_RE.match(name):
            raise ConfigError(f"{name!r} is not an sbatch long option name", key=f"{key}.{name}",
                              fix="use the long option without dashes, e.g. reservation: myres")
        clash = next((r for r in RESERVED_SBATCH if r == name or (r.startswith(name) and len(name) >= 2)), None)
        if clash is not None:
            raise ConfigError(f"--{clash} is set by embodyhpc itself; a second #SBATCH line would override it",
                              key=f"{key}.{name}", fix="remove it (use the recipe's own key for it, e.g. "
                              "resources.time, site.partition)")
        no_control_chars(f"{key}.{name}", str(value))


def node_names(key: str, names: list[str]) -> None:
    """Slurm node names or hostlist ranges (n1, gpu-[01-04]): what sbatch --exclude takes, and nothing a shell or
    sbatch would read as more (a comma inside one entry, spaces, options)."""
    for name in names:
        if not isinstance(name, str) or not _NODE_RE.match(name) or len(name) > MAX_NODE_NAME_LEN:
            raise ConfigError(f"{name!r} is not a Slurm node name or range (e.g. n1 or gpu-[01-04])", key=key,
                              fix="list one node or range per entry, e.g. [n1, gpu-[01-04]]")


def path_name(key: str, value: str) -> None:
    """A name that becomes a path component and part of Slurm job names: letters, digits, . _ + - only.
    `%` would turn into a Slurm/submitit filename pattern (%j), '/' or '..' would leave the run folder."""
    if not value or not _NAME_RE.match(value) or value in (".", ".."):
        raise ConfigError(f"{value!r} is not a plain name (letters, digits, '.', '_', '+', '-'; not starting "
                          "with '.', '-', '+')", key=key, fix=f"set {key} to e.g. my-run_1")
    if len(value) > MAX_NAME_LEN:
        raise ConfigError(f"is {len(value)} characters long; at most {MAX_NAME_LEN}", key=key,
                          fix="use a shorter name")


def runs_root(key: str, value: str) -> None:
    """The folder run folders go under: checked here, before anything is created, instead of an ENAMETOOLONG
    traceback at submit or a `%j` pattern scattering logs into sibling folders."""
    if not str(value).strip():
        raise ConfigError("is empty (it would silently mean the current folder)", key=key,
                          fix=f"set {key}=./runs or an absolute folder")
    if "%" in value:
        raise ConfigError("contains '%', which Slurm and submitit read as a filename pattern (%j)", key=key,
                          fix="use a folder without '%'")
    for part in value.split("/"):
        if len(part.encode()) > 255:
            raise ConfigError(f"has a path component of {len(part.encode())} bytes; file systems allow 255",
                              key=key, fix="use a shorter folder name")
    absolute = os.path.abspath(os.path.expanduser(value))
    budget = os.pathconf("/", "PC_PATH_MAX") if hasattr(os, "pathconf") else 4096
    longest = len(absolute.encode()) + 2 * MAX_NAME_LEN + RUN_DIR_DEPTH_RESERVE
    if longest >= budget:
        raise ConfigError(f"is {len(absolute.encode())} bytes long: files of a run below it would pass the "
                          f"{budget}-byte path limit", key=key, fix="use a shorter folder")
