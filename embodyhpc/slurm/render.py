"""A job's shape -> sbatch text, as a pure function of the loaded recipe (the site's values), the job's shape
(embodyhpc.orchestrate.plan computes it: resources, environment, command) and the run directory.

The templates in sbatch_templates/ (or a site's `templates_dir`) are Jinja2 with shell
"autoescaping": every value that reaches a script is passed through `shlex.quote` by the
environment's finalizer, unless our own code marked it as already-quoted shell text (`Shell`).
A template author cannot forget to quote a recipe value.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.errors import ConfigError
from embodyhpc.rundir import submitit_folder

JOB_KINDS = ("train", "export", "eval", "report", "smoke")
HET_JOB_KINDS = ("rl",)
"""Jobs of several groups (a heterogeneous job, rl.sbatch.j2): rendered only for a recipe that has them."""
SIGNAL = "USR2"  # submitit's handler listens for it (timeout and preemption)


class Shell(str):
    """Text our code assembled from quoted parts: emitted verbatim by templates."""


def shell_join(args: Iterable[str]) -> Shell:
    return Shell(" ".join(shlex.quote(str(a)) for a in args))


def script_value(value: object) -> str:
    if isinstance(value, Shell):
        return value
    if value is None:
        raise jinja2.TemplateError("a template printed an unset value; guard it with {% if %}")
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if any(ord(c) < 32 for c in text):
        raise jinja2.TemplateError(f"refusing to render a value with a control character: {text!r}")
    return shlex.quote(text)


_TEMPLATE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\.j2$")


def _plain_template_name(name: str) -> bool:
    """Templates include each other by bare file name: no folders, no absolute paths, no '..'."""
    return bool(_TEMPLATE_NAME.match(name)) and ".." not in name


def _load_shipped(name: str) -> str | None:
    if not _plain_template_name(name):
        return None
    node = resources.files("embodyhpc.sbatch_templates").joinpath(name)
    return node.read_text() if node.is_file() else None


class _FolderLoader(jinja2.BaseLoader):
    """A site's template folder: bare names only, and only regular files inside the folder (a symlink that points
    out of it is refused), so `{% include "/etc/passwd" %}` or `"../x"` can never read another file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder.resolve()

    def get_source(self, environment: jinja2.Environment, template: str):  # type: ignore[override]
        if not _plain_template_name(template):
            raise jinja2.TemplateNotFound(template)
        path = (self.folder / template).resolve()
        if path.parent != self.folder or not path.is_file():
            raise jinja2.TemplateNotFound(template)
        text = path.read_text()
        mtime = path.stat().st_mtime
        return text, str(path), lambda: path.stat().st_mtime == mtime


def check_templates_dir(templates_dir: str | None) -> Path | None:
    """The same check at validate, render and submit."""
    if not templates_dir:
        return None
    folder = Path(templates_dir).expanduser()
    if not folder.is_dir():
        raise ConfigError("template folder does not exist", key="site.templates_dir",
                          where=str(folder), fix="point site.templates_dir at a copy of sbatch_templates/")
    return folder


def template_env(templates_dir: str | None) -> jinja2.Environment:
    """A sandboxed Jinja environment: a template (e.g. in a site's folder, or one a recipe's user was handed)
    cannot reach Python objects' internals, call unsafe methods or change data: rendering never runs code."""
    loaders: list[jinja2.BaseLoader] = []
    folder = check_templates_dir(templates_dir)
    if folder is not None:
        loaders.append(_FolderLoader(folder))
    loaders.append(jinja2.FunctionLoader(_load_shipped))
    return ImmutableSandboxedEnvironment(
        loader=jinja2.ChoiceLoader(loaders),
        finalize=script_value,
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


class HetGroup(Protocol):
    """One group of a heterogeneous job (embodyhpc.orchestrate.plan.HetGroup), read here by its attributes."""

    role: str
    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    mem: str
    gpus: int
    partition: str | None


class JobShape(Protocol):
    """What the script (render_jobs) and submitit (executor.RecipeExecutor) read of a job: the plan's job shape
    (embodyhpc.orchestrate.plan.JobShape, computed once per job), read here by its attributes."""

    kind: str
    nodes: int
    tasks_per_node: int
    time_min: int
    array_size: int
    array_parallelism: int
    cpus_per_task: int
    mem: str
    gpus: int
    whole_node: bool
    signal_delay_s: int
    env: Mapping[str, str]
    command: str
    groups: Sequence[HetGroup]

    @property
    def tasks(self) -> int: ...


def submitit_command(python: str, run_dir: Path) -> Shell:
    """The command submitit puts into the script (see SlurmExecutor._submitit_command_str). A run directory or python
    with a control character is refused here, where both enter the job's command."""
    _refuse_control_characters(python, run_dir)
    return Shell(" ".join([shlex.quote(python), "-u -m submitit.core._submit",
                           shlex.quote(str(submitit_folder(run_dir)))]))


def module_command(python: str, module: str, run_dir: Path) -> Shell:
    """`python -u -m <module> <run_dir>`, quoted: what a job that embodyhpc submits itself runs (the RL job)."""
    _refuse_control_characters(python, run_dir)
    return shell_join([python, "-u", "-m", module, str(run_dir)])


def _refuse_control_characters(python: str, run_dir: Path) -> None:
    for text, what, key in ((str(run_dir), "the run directory", "--run-dir"), (python, "the python", "site.python")):
        if any(ord(c) < 32 or ord(c) == 127 for c in text):
            raise ConfigError(f"{what} contains a newline or control character: {text!r}", key=key,
                              fix="use a path without control characters")


def log_paths(run_dir: Path, array: bool) -> tuple[str, str]:
    """stdout/stderr patterns as submitit's JobPaths writes them (%j, or %A_%a for arrays)."""
    return _log_patterns(submitit_folder(run_dir), array)


def _log_patterns(folder: Path, array: bool) -> tuple[str, str]:
    job = "%A_%a" if array else "%j"
    return f"{folder}/{job}_%t_log.out", f"{folder}/{job}_%t_log.err"


def _sbatch_context(loaded: LoadedRecipe, shape: JobShape, folder: Path) -> dict[str, object]:
    cfg = loaded.config
    site = cfg.site
    stdout, stderr = _log_patterns(folder, array=shape.array_size > 0)
    hours, minutes = divmod(shape.time_min, 60)
    return {
        "job_name": f"{cfg.job.name}-{shape.kind}",
        "partition": site.partition,
        "account": site.account,
        "qos": site.qos,
        "constraint": site.constraint if shape.whole_node else None,
        "exclusive": site.exclusive and shape.whole_node,
        "nodes": shape.nodes,
        "ntasks_per_node": shape.tasks_per_node,
        "cpus_per_task": shape.cpus_per_task,
        "mem": shape.mem,
        "gpus": shape.gpus if site.gpu_request != "none" else 0,
        "gpu_request": site.gpu_request,
        "time": f"{hours:02d}:{minutes:02d}:00",
        "signal": f"{SIGNAL}@{shape.signal_delay_s}",
        "array": f"0-{shape.array_size - 1}%{shape.array_parallelism}" if shape.array_size else None,
        "stdout_sbatch": stdout.replace("%t", "0"),
        "stderr_sbatch": stderr.replace("%t", "0"),
        "stdout": stdout,
        "stderr": stderr,
        "extra_sbatch": dict(site.extra_sbatch),
        "exclude": ",".join(site.exclude) or None,
    }


def _srun_container(loaded: LoadedRecipe) -> Shell | None:
    container = loaded.config.site.container
    if not container.image:
        return None
    args = ["--container-image", container.image]
    if container.mounts:
        args += ["--container-mounts", ",".join(container.mounts)]
    if container.workdir:
        args += ["--container-workdir", container.workdir]
    return shell_join([*args, *container.extra_args])


def render_jobs(loaded: LoadedRecipe, shapes: Sequence[JobShape], run_dir: Path) -> list[str]:
    """The exact sbatch text of each job: its shape (resources, environment, command: the plan's) in the site's
    template. The plan (embodyhpc.orchestrate.plan) calls this once for all its jobs; `embodyhpc render`, the dry run
    and both backends read the text from the plan, so what render prints is byte-for-byte what sbatch receives."""
    cfg = loaded.config
    env, folder, container = template_env(cfg.site.templates_dir), submitit_folder(run_dir), _srun_container(loaded)
    scripts = []
    for shape in shapes:
        context = {
            "sbatch": _sbatch_context(loaded, shape, folder),
            "modules": list(cfg.site.modules),
            "env": dict(shape.env),
            "run_dir": str(run_dir),
            "srun_container": container,
            "command": Shell(shape.command),
            "kind": shape.kind,
            "recipe": loaded.recipe,
            **_het_context(loaded, shape, folder),
        }
        scripts.append(_render(env, f"{shape.kind}.sbatch.j2", context, custom=bool(cfg.site.templates_dir)))
    return scripts


def _het_context(loaded: LoadedRecipe, shape: JobShape, folder: Path) -> dict[str, object]:
    """What rl.sbatch.j2 reads of a heterogeneous job: `components`, the #SBATCH blocks (one per group, or the one
    allocation of site.het_jobs: false), and `groups` with the role, node offset and log paths of each group."""
    if not shape.groups:
        return {"het_jobs": False, "components": [], "groups": [], "ntasks": shape.nodes * shape.tasks_per_node}
    site = loaded.config.site
    if shape.array_size:
        raise ConfigError(f"the {shape.kind} job has {len(shape.groups)} groups and an array of {shape.array_size}: "
                          "Slurm runs no heterogeneous job as an array", fix="submit one job per array element")

    def component(role: str, r: HetGroup | JobShape, partition: str | None) -> dict[str, object]:
        return {"role": role, "partition": partition or site.partition, "nodes": r.nodes,
                "ntasks_per_node": r.tasks_per_node, "cpus_per_task": r.cpus_per_task, "mem": r.mem,
                "gpus": r.gpus if site.gpu_request != "none" else 0,
                "constraint": site.constraint if r.gpus else None, "exclusive": site.exclusive and bool(r.gpus)}

    groups, offset = [], 0
    for group in shape.groups:
        stdout, stderr = (Shell(f'{shlex.quote(str(folder))}/"${{SLURM_JOB_ID}}"'
                                f'{shlex.quote(f"_{group.role}-%t_log.{ext}")}') for ext in ("out", "err"))
        groups.append({**component(group.role, group, group.partition), "node_offset": offset,
                       "stdout": stdout, "stderr": stderr})
        offset += group.nodes
    if site.het_jobs:
        return {"het_jobs": True, "components": groups, "groups": groups, "ntasks": shape.tasks}
    partitions = {group.partition or site.partition for group in shape.groups}
    if len(partitions) > 1:
        named = ", ".join(f"{g.role}: {g.partition or site.partition}" for g in shape.groups)
        raise ConfigError(f"one allocation (site.het_jobs: false) has one partition, the {shape.kind} job's groups "
                          f"ask for several ({named})", key="site.het_jobs",
                          fix="give every rl.resources.<role>.partition the same partition (or none), or run on a "
                              "site that allows heterogeneous jobs (site.het_jobs: true)")
    one = component("all", shape, partitions.pop())
    one["constraint"] = site.constraint if shape.whole_node else None
    one["exclusive"] = site.exclusive and shape.whole_node
    return {"het_jobs": False, "components": [one], "groups": groups, "ntasks": shape.tasks}


def _render(env: jinja2.Environment, name: str, context: dict[str, object], *, custom: bool) -> str:
    try:
        return env.get_template(name).render(context)
    except (SecurityError, OverflowError) as exc:  # OverflowError: the sandbox's cap on range()
        raise ConfigError(f"template {name} tried something a sandboxed template may not: {exc}",
                          key="site.templates_dir" if custom else None,
                          fix="templates may only print values and use Jinja's statements") from exc
    except jinja2.TemplateNotFound as exc:
        raise ConfigError(f"template {name} includes {exc.name!r}, which is not a template of this folder or the "
                          "shipped ones", key="site.templates_dir" if custom else None,
                          fix="include templates by bare file name, e.g. base.sbatch.j2") from exc
    except jinja2.TemplateError as exc:
        raise ConfigError(f"template {name} failed: {exc}", key="site.templates_dir" if custom else None) from exc


def job_python(cfg) -> str:
    """The python jobs run: site.python; in a container, the container's own `python3` (the submitting machine's
    venv path means nothing inside the image); else the interpreter running embodyhpc."""
    if cfg.site.python:
        return cfg.site.python
    return "python3" if cfg.site.container.image else sys.executable
