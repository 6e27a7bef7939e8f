"""The chain of a run, described once as data; both backends execute this description.

    training run:          train -> eval array (afterok) -> report (afterany)
    evaluation of weights: [export ->] eval array (afterok) -> report (afterany)   (`embodyhpc eval`, and the
                           evaluations of checkpoints that training starts while it runs)
    smoke:                 one smoke job

A failed training (or export) cancels the evaluation array; the report still runs and records why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.evaluate import evaluated_checkpoint
from embodyhpc.plugins import import_name

TASKS = {
    "train": "embodyhpc.launch.train:train_task",
    "export": "embodyhpc.launch.export:export_task",
    "eval": "embodyhpc.launch.eval:eval_shard_task",
    "report": "embodyhpc.launch.report:report_task",
    "smoke": "embodyhpc.launch.smoke:smoke_task",
}
"""Each job kind's task, `module:function`: called with the run directory (and the shard index, in an array)."""


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
    """The jobs of this recipe's chain, in order: train -> eval -> report (no eval array when eval.enabled is
    false). An evaluation of weights that exist (`embodyhpc eval`, evaluations while training runs) has no training;
    it starts with an export job when eval.weights is a run's checkpoints/step-N folder."""
    if eval_only:
        return (["export"] if evaluated_checkpoint(loaded.config.eval) else []) + ["eval", "report"]
    return ["train"] + (["eval"] if loaded.config.eval.enabled else []) + ["report"]


def chain_plan(loaded: LoadedRecipe, *, eval_only: bool = False) -> list[JobSpec]:
    """The jobs of the chain in submission order, each after the jobs it depends on."""
    jobs: list[JobSpec] = []
    for kind in chain_kinds(loaded, eval_only=eval_only):
        before = tuple(job.kind for job in jobs)
        if kind == "eval":  # the training (or export) it evaluates
            ev = loaded.config.eval
            jobs.append(JobSpec(kind, TASKS[kind], before[:1], "afterok", ev.shards, ev.array_parallelism))
        elif kind == "report":  # whatever happened before: it records why a chain did not complete
            jobs.append(JobSpec(kind, TASKS[kind], before, "afterany"))
        else:
            jobs.append(JobSpec(kind, TASKS[kind],
                                starts_evals=kind == "train" and bool(loaded.config.eval.every_k_checkpoints)))
    return jobs


def smoke_plan() -> list[JobSpec]:
    """`embodyhpc smoke --submit`: one job on one node with the training job's resources."""
    return [JobSpec("smoke", TASKS["smoke"])]


def resolve_task(name: str) -> Callable[..., object]:
    """The function a `module:function` name points to (imported now, in the process that starts the job)."""
    return import_name(name)
