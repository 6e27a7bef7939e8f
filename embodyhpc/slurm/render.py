"""Recipe -> sbatch text, as a pure function of the loaded recipe, the run directory and python.

The templates in sbatch_templates/ (or a site's `templates_dir`) are Jinja2 with shell
"autoescaping": every value that reaches a script is passed through `shlex.quote` by the
environment's finalizer, unless our own code marked it as already-quoted shell text (`Shell`).
A template author cannot forget to quote a recipe value.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.errors import ConfigError
from embodyhpc.rundir import submitit_folder

JOB_KINDS = ("train", "export", "eval", "report", "smoke")
SMOKE_TIME_MIN = 60  # embodyhpc smoke --submit: ~17 short trainings, inductor compiles included
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


@dataclass(frozen=True)
class JobShape:
    """What submitit needs to know about a job besides its script."""

    kind: str
    nodes: int
    tasks_per_node: int
    time_min: int
    array_size: int = 0  # 0: not an array
    array_parallelism: int = 1


def job_shape(loaded: LoadedRecipe, kind: str) -> JobShape:
    cfg, res = loaded.config, loaded.resolved
    if kind == "train":
        return JobShape(kind, cfg.resources.nodes, res.procs_per_node, res.train_time_min)
    if kind == "export":  # one process reads the checkpoint's model entries: an evaluation shard's resources
        return JobShape(kind, 1, 1, res.eval_time_min)
    if kind == "eval":
        ev = cfg.eval
        return JobShape(kind, 1, 1, res.eval_time_min, array_size=ev.shards,
                        array_parallelism=min(ev.shards, ev.array_parallelism))
    if kind == "report":
        return JobShape(kind, 1, 1, 15)
    if kind == "smoke":  # one process on one node; its FSDP row starts one rank per GPU itself
        return JobShape(kind, 1, 1, SMOKE_TIME_MIN)
    raise ValueError(f"unknown job kind {kind!r}; expected one of {JOB_KINDS}")


def submitit_command(python: str, run_dir: Path) -> Shell:
    """The command submitit puts into the script (see SlurmExecutor._submitit_command_str)."""
    return Shell(" ".join([shlex.quote(python), "-u -m submitit.core._submit",
                           shlex.quote(str(submitit_folder(run_dir)))]))


def log_paths(run_dir: Path, array: bool) -> tuple[str, str]:
    """stdout/stderr patterns as submitit's JobPaths writes them (%j, or %A_%a for arrays)."""
    job = "%A_%a" if array else "%j"
    folder = submitit_folder(run_dir)
    return f"{folder}/{job}_%t_log.out", f"{folder}/{job}_%t_log.err"


def _sbatch_context(loaded: LoadedRecipe, shape: JobShape, run_dir: Path) -> dict[str, object]:
    cfg = loaded.config
    site = cfg.site
    if shape.kind in ("train", "smoke"):  # the smoke job checks a training node: the same request
        res = cfg.resources
        cpus, mem, gpus = res.cpus_per_task, res.mem, res.gpus_per_node
    elif shape.kind == "eval":  # one task per shard: a node-level request is the task's
        cpus, mem, gpus = cfg.eval.cpus_per_task, cfg.eval.mem, cfg.eval.gpus_per_task
    elif shape.kind == "export":
        cpus, mem, gpus = cfg.eval.cpus_per_task, cfg.eval.mem, 0
    else:
        cpus, mem, gpus = 1, "2G", 0
    stdout, stderr = log_paths(run_dir, array=shape.array_size > 0)
    hours, minutes = divmod(shape.time_min, 60)
    return {
        "job_name": f"{cfg.job.name}-{shape.kind}",
        "partition": site.partition,
        "account": site.account,
        "qos": site.qos,
        "constraint": site.constraint if shape.kind in ("train", "smoke") else None,
        "exclusive": site.exclusive and shape.kind in ("train", "smoke"),
        "nodes": shape.nodes,
        "ntasks_per_node": shape.tasks_per_node,
        "cpus_per_task": cpus,
        "mem": mem,
        "gpus": gpus if site.gpu_request != "none" else 0,
        "gpu_request": site.gpu_request,
        "time": f"{hours:02d}:{minutes:02d}:00",
        "signal": f"{SIGNAL}@{cfg.resources.signal_delay_s if shape.kind == 'train' else 60}",
        "array": f"0-{shape.array_size - 1}%{shape.array_parallelism}" if shape.array_size else None,
        "stdout_sbatch": stdout.replace("%t", "0"),
        "stderr_sbatch": stderr.replace("%t", "0"),
        "stdout": stdout,
        "stderr": stderr,
        "extra_sbatch": dict(site.extra_sbatch),
        "exclude": ",".join(site.exclude) or None,
    }


def render_job(loaded: LoadedRecipe, kind: str, run_dir: Path, python: str,
               command: str | None = None) -> str:
    """The exact sbatch text for one job of the chain.

    `command` is what submitit asks to run; when omitted it is derived the way submitit derives
    it, so `embodyhpc render` prints byte-for-byte what `submit` hands to sbatch.
    """
    cfg = loaded.config
    shape = job_shape(loaded, kind)
    container = cfg.site.container
    srun_container: list[str] = []
    if container.image:
        srun_container += ["--container-image", container.image]
        if container.mounts:
            srun_container += ["--container-mounts", ",".join(container.mounts)]
        if container.workdir:
            srun_container += ["--container-workdir", container.workdir]
        srun_container += list(container.extra_args)
    env = {"EMBODYHPC_RUN_DIR": str(run_dir), "EMBODYHPC_JOB_KIND": kind, **dict(cfg.site.env)}
    if kind in ("train", "smoke"):
        env.update(cfg.network.environment())
    context = {
        "sbatch": _sbatch_context(loaded, shape, run_dir),
        "modules": list(cfg.site.modules),
        "env": env,
        "run_dir": str(run_dir),
        "srun_container": shell_join(srun_container) if srun_container else None,
        "command": Shell(command) if command is not None else submitit_command(python, run_dir),
        "kind": kind,
        "recipe": loaded.recipe,
    }
    for what, text in (("the run directory", str(run_dir)), ("the python", python)):
        if any(ord(c) < 32 or ord(c) == 127 for c in text):
            key = "--run-dir" if what == "the run directory" else "site.python"
            raise ConfigError(f"{what} contains a newline or control character: {text!r}", key=key,
                              fix="use a path without control characters")
    custom = bool(cfg.site.templates_dir)
    name = f"{kind}.sbatch.j2"
    try:
        return template_env(cfg.site.templates_dir).get_template(name).render(context)
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
