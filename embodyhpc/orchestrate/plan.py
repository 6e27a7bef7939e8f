"""The chain of a run, described once as data; both backends execute this description.

    training run:          train -> eval array (afterok) -> report (afterany)
    RL run (rl.enabled):   rl -> eval array (afterok) -> report (afterany)   (one heterogeneous job replaces train)
    evaluation of weights: [export ->] eval array (afterok) -> report (afterany)   (`embodyhpc eval`, and the
                           evaluations of checkpoints that training starts while it runs)
    smoke:                 one smoke job

A failed training (or export) cancels the evaluation array; the report still runs and records why.

A `Plan` is the chain for one run directory: each job's dependencies (JobSpec), its shape (resources, environment,
command: `job_shape`) and its sbatch script, each computed once, here. Everything downstream reads the plan: the
dry run, `embodyhpc render`, the Slurm backend (the script is what sbatch receives) and the local backend (the
shape's processes, time limit and environment; the script is written to scripts/ for reference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.config.rl_schema import ROLES as RL_ROLES  # the RL job's groups in order: het group 0, 1, 2
from embodyhpc.config.rl_schema import RoleGroup
from embodyhpc.errors import ConfigError
from embodyhpc.evaluate import evaluated_checkpoint
from embodyhpc.plugins import import_name
from embodyhpc.rundir import script_file
from embodyhpc.slurm.render import module_command, render_jobs, submitit_command

TASKS = {
    "train": "embodyhpc.launch.train:train_task",
    "rl": "embodyhpc.launch.rl:rl_task",
    "export": "embodyhpc.launch.export:export_task",
    "eval": "embodyhpc.launch.eval:eval_shard_task",
    "report": "embodyhpc.launch.report:report_task",
    "smoke": "embodyhpc.launch.smoke:smoke_task",
}
"""Each job kind's task, `module:function`: called with the run directory (and the shard index, in an array)."""
SMOKE_TIME_MIN = 60  # embodyhpc smoke --submit: ~17 short trainings, inductor compiles included
REPORT_TIME_MIN = 15
RL_MODULE = "embodyhpc.launch.rl"
"""What every process of the RL job runs: `python -m embodyhpc.launch.rl <run_dir>` (TASKS["rl"] behind it); the
role comes from the environment (embodyhpc.rl.roles)."""


@dataclass(frozen=True)
class JobSpec:
    kind: str
    task: str
    """`module:function` (TASKS), resolved when the job is started (`resolve_task`)."""
    after: tuple[str, ...] = ()
    """The kinds this job waits for."""
    condition: str = "afterok"
    """afterok: runs only if every job in `after` completed (else it is cancelled); afterany: runs when they end."""
    array_size: int = 0
    """0: one job; N: an array of N elements, element i called with shard i."""
    array_parallelism: int = 0
    """At most this many elements of the array run at once (0: no limit)."""
    starts_evals: bool = False
    """While it runs, the job may ask for evaluation chains of its checkpoints (<run>/evals/step-N, made by
    embodyhpc.launch.checkpoint_eval): on Slurm it submits them itself; the local backend runs them beside it."""


def chain_kinds(loaded: LoadedRecipe, *, eval_only: bool = False) -> list[str]:
    """The jobs of this recipe's chain, in order: train (rl for an RL recipe) -> eval -> report (no eval array
    when eval.enabled is false). An evaluation of weights that exist (`embodyhpc eval`, evaluations while training
    runs) has no training; it starts with an export job when eval.weights is a run's checkpoints/step-N folder."""
    if eval_only:
        return (["export"] if evaluated_checkpoint(loaded.config.eval) else []) + ["eval", "report"]
    first = "rl" if loaded.config.rl.enabled else "train"
    return [first] + (["eval"] if loaded.config.eval.enabled else []) + ["report"]


def chain_specs(loaded: LoadedRecipe, *, eval_only: bool = False) -> list[JobSpec]:
    """The jobs of the chain in submission order, each after the jobs it depends on."""
    jobs: list[JobSpec] = []
    for kind in chain_kinds(loaded, eval_only=eval_only):
        before = tuple(job.kind for job in jobs)
        if kind == "eval":  # the training (RL, export) it evaluates
            ev = loaded.config.eval
            jobs.append(JobSpec(kind, TASKS[kind], before[:1], "afterok", ev.shards, ev.array_parallelism))
        elif kind == "report":  # whatever happened before: it records why a chain did not complete
            jobs.append(JobSpec(kind, TASKS[kind], before, "afterany"))
        else:
            jobs.append(JobSpec(kind, TASKS[kind],
                                starts_evals=kind == "train" and bool(loaded.config.eval.every_k_checkpoints)))
    return jobs


@dataclass(frozen=True)
class HetGroup:
    """One group of a heterogeneous job (one `#SBATCH hetjob` component; the RL job's actor, rollout or env)."""

    role: str
    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    mem: str
    gpus: int  # per node
    partition: str | None = None
    """None: the site's partition."""

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True)
class JobShape:
    """One job's resources, environment and command, computed once (job_shape). The script (slurm.render), submitit
    (slurm.executor) and the local backend read it."""

    kind: str
    nodes: int
    tasks_per_node: int
    time_min: int
    array_size: int = 0  # 0: not an array
    array_parallelism: int = 1
    cpus_per_task: int = 1
    mem: str = "2G"
    gpus: int = 0  # per node (per task for an evaluation shard)
    whole_node: bool = False
    """The site's node constraint and exclusivity apply (training and smoke: they check a training node)."""
    signal_delay_s: int = 60
    """Slurm signals the job this many seconds before its time limit."""
    env: Mapping[str, str] = field(default_factory=dict)
    """What the job's processes find in their environment (the script exports it; the local backend sets it)."""
    command: str = ""
    """What the job runs: submitit's command (slurm.render.submitit_command), shell-quoted."""
    max_requeues: int = 3
    """How often submitit puts the job back in the queue after a timeout or preemption."""
    groups: tuple[HetGroup, ...] = ()
    """A heterogeneous job's groups in order (the RL job: actor, rollout, env); () for every other job. With groups,
    nodes/tasks_per_node/cpus_per_task/mem/gpus are what one allocation holding all of them asks for (the site's
    fallback, site.het_jobs: false): the groups' nodes summed, each node sized for the largest group."""

    @property
    def tasks(self) -> int:
        """Every process of the job (the groups' together): what the local backend starts."""
        if self.groups:
            return sum(group.tasks for group in self.groups)
        return self.nodes * self.tasks_per_node


def job_shape(loaded: LoadedRecipe, kind: str, run_dir: Path, command: str) -> JobShape:
    """What one job asks for and runs with: nodes, tasks, time, array, cpus/mem/gpus, its environment, `command`."""
    cfg, res = loaded.config, loaded.resolved
    env = {"EMBODYHPC_RUN_DIR": str(run_dir), "EMBODYHPC_JOB_KIND": kind, **dict(cfg.site.env)}
    if kind in ("train", "smoke"):
        env.update(cfg.network.environment())
    r, ev = cfg.resources, cfg.eval
    common = {"env": env, "command": command, "max_requeues": r.max_requeues}
    node = {"cpus_per_task": r.cpus_per_task, "mem": r.mem, "gpus": r.gpus_per_node, "whole_node": True}
    if kind == "train":
        return JobShape(kind, r.nodes, res.procs_per_node, res.train_time_min, **node,
                        signal_delay_s=r.signal_delay_s, **common)
    if kind == "smoke":  # one process on one node, a training node's request; its FSDP row starts a rank per GPU
        return JobShape(kind, 1, 1, SMOKE_TIME_MIN, **node, **common)
    if kind == "eval":  # one task per shard: a node-level request is the task's
        return JobShape(kind, 1, 1, res.eval_time_min, ev.shards, min(ev.shards, ev.array_parallelism),
                        ev.cpus_per_task, ev.mem, ev.gpus_per_task, **common)
    if kind == "export":  # one process reads the checkpoint's model entries: an evaluation shard's resources
        return JobShape(kind, 1, 1, res.eval_time_min, cpus_per_task=ev.cpus_per_task, mem=ev.mem, **common)
    if kind == "report":
        return JobShape(kind, 1, 1, REPORT_TIME_MIN, **common)
    if kind == "rl":
        return _rl_shape(loaded, env, common)
    raise ValueError(f"unknown job kind {kind!r}; expected one of {tuple(TASKS)}")


def _rl_shape(loaded: LoadedRecipe, env: dict[str, str], common: dict) -> JobShape:
    """The RL job: its groups from rl.resources (rl-config's RLConfig.group resolves each role's processes), the
    training job's time, signal delay and network environment; EMBODYHPC_RL_SIZES tells every process how many of
    each role there are (embodyhpc.rl.roles maps a rank to its role with it)."""
    cfg = loaded.config
    if not cfg.rl.enabled:
        raise ConfigError("the rl job is the job of an RL recipe; this recipe has rl.enabled: false",
                          key="rl.enabled", fix="set rl.enabled=true, or render the train job")
    groups = tuple(_het_group(cfg.rl.group(role)) for role in RL_ROLES)
    sizes = ",".join(f"{group.role}={group.tasks}" for group in groups)
    common = {**common, "env": {**env, **cfg.network.environment(), "EMBODYHPC_RL_SIZES": sizes}}
    return JobShape("rl", sum(g.nodes for g in groups), max(g.tasks_per_node for g in groups),
                    loaded.resolved.train_time_min, cpus_per_task=max(g.cpus_per_task for g in groups),
                    mem=max((g.mem for g in groups), key=mem_megabytes), gpus=max(g.gpus for g in groups),
                    whole_node=any(g.gpus for g in groups), signal_delay_s=cfg.resources.signal_delay_s,
                    groups=groups, **common)


def _het_group(group: RoleGroup) -> HetGroup:
    return HetGroup(group.role, group.nodes, group.tasks_per_node, group.cpus_per_task, group.mem,
                    group.gpus_per_node, group.partition)


_MEM_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def mem_megabytes(mem: str) -> float:
    """sbatch --mem text in megabytes, for comparing sizes; "0" (all of a node's memory) is the largest."""
    number, unit = (mem[:-1], mem[-1]) if mem[-1:].isalpha() else (mem, "M")
    return float("inf") if int(number) == 0 else int(number) * _MEM_UNITS[unit.upper()]


@dataclass(frozen=True)
class Job:
    """One job of a plan: what it waits for and runs (spec), what it asks for (shape), its sbatch text (script)."""

    kind: str
    spec: JobSpec
    shape: JobShape
    script: str
    script_path: Path


@dataclass(frozen=True)
class Plan:
    """The jobs of one run directory, in submission order, each with its shape and script computed once."""

    run_dir: Path
    python: str
    jobs: tuple[Job, ...]


def make_plan(loaded: LoadedRecipe, specs: list[JobSpec], run_dir: Path, python: str) -> Plan:
    """Each job's shape and script (slurm.render: once per job). A broken or refused template raises here."""
    command = submitit_command(python, run_dir)  # every job of a run runs submitit's one command, but the RL job:
    rl_command = module_command(python, RL_MODULE, run_dir)  # a heterogeneous job submitit cannot submit
    paths = [script_file(run_dir, spec.kind) for spec in specs]
    shapes = [job_shape(loaded, spec.kind, run_dir, rl_command if spec.kind == "rl" else command) for spec in specs]
    scripts = render_jobs(loaded, shapes, run_dir)
    return Plan(Path(run_dir), python, tuple([Job(spec.kind, spec, shape, script, path) for spec, shape, script, path
                                              in zip(specs, shapes, scripts, paths, strict=True)]))


def chain_plan(loaded: LoadedRecipe, run_dir: Path, python: str, *, eval_only: bool = False) -> Plan:
    """The recipe's chain (chain_specs) for `run_dir`."""
    return make_plan(loaded, chain_specs(loaded, eval_only=eval_only), run_dir, python)


def kind_plan(loaded: LoadedRecipe, kind: str, run_dir: Path, python: str) -> Plan:
    """One job of `kind` alone (`embodyhpc render --job KIND`; smoke_plan)."""
    return make_plan(loaded, [JobSpec(kind, TASKS[kind])], run_dir, python)


def smoke_plan(loaded: LoadedRecipe, run_dir: Path, python: str) -> Plan:
    """`embodyhpc smoke --submit`: one job on one node with the training job's resources."""
    return kind_plan(loaded, "smoke", run_dir, python)


def resolve_task(name: str) -> Callable[..., object]:
    """The function a `module:function` name points to (imported now, in the process that starts the job)."""
    return import_name(name)
