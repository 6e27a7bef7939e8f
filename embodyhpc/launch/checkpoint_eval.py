"""Evaluations of checkpoints while training goes on (`eval.every_k_checkpoints: k`).

Which: every k-th periodic checkpoint, that is steps that are multiples of k x checkpoint.every_steps, short of
train.steps (the run's own chain evaluates its final export). A preemption save counts when its step is one of
those; a step evaluated once (by an earlier attempt of a requeued job) is not evaluated again.

How, for step N: the checkpointer's completion hook on rank 0 of the training job (for async saves that is the
checkpoint finisher thread: the training thread never waits for any of this) calls `request`, which
1. makes <run>/evals/step-N/ an evaluation run directory (embodyhpc.orchestrate.api.start_run): resolved.yaml
   is the run's recipe with eval.weights = <run>/checkpoints/step-N and no reference rows (the run's own chain
   evaluates those once: they do not change with the checkpoint), run.json names the training run as parent_run
   and shares its MLflow run, and the checkpoint gets this evaluation's pin, so retention (checkpoint.keep_latest_k)
   keeps it until the export job has read it;
2. runs the chain `embodyhpc eval --ckpt` runs, on the evaluation's own resources (eval.cpus_per_task, eval.mem,
   eval.time): export (-> <run>/exports/step-N, then unpin) -> eval array (afterok) -> report (afterany):
   - Slurm: submitted from inside the training job (sbatch without the job's own SLURM_* variables);
   - local: the `submit` process, which waits for training anyway, finds the folder and runs the chain beside
     training (embodyhpc.orchestrate.backend_local), one evaluation at a time.
The report logs a child MLflow run of the training run at step N and adds step N to the training run's
eval/history.jsonl, so the success-vs-step plot grows while training runs; `embodyhpc status RUN` lists them.
Failures here never reach training: they are printed, and that step goes unevaluated.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

from embodyhpc.checkpoint import layout
from embodyhpc.config.schema import Config
from embodyhpc.rundir import RESOLVED_YAML, eval_run_dir, make_run_dir
from embodyhpc.runinfo import RunInfo


def evaluates_step(config: Config, step: int) -> bool:
    """Whether the checkpoint of `step` is one of those evaluated while training runs."""
    k = config.eval.every_k_checkpoints
    if not (config.eval.enabled and k) or not 0 < step < config.train.steps:
        return False
    return step % (k * config.checkpoint.every_steps) == 0


def request(run: Path, step: int, checkpoint: Path, progress: Callable[[str], None] = print) -> Path | None:
    """Evaluate `checkpoint` (complete) of the training run `run`: its run directory, and on Slurm its chain.
    Returns the evaluation run directory, or None when that step was asked for before."""
    from embodyhpc.orchestrate.api import run_chain, start_run
    from embodyhpc.validation import load_recipe

    target = eval_run_dir(run, step)
    parent = RunInfo.load(run)
    # the reference rows (expert, random) do not change with the checkpoint: the run's own chain evaluates them once
    loaded = load_recipe(str(Path(run) / RESOLVED_YAML), [f"eval.weights={checkpoint}", "eval.reference_policies=[]"],
                         recipe_site_keys="keep")
    if not make_run_dir(target):
        return None
    info = start_run(loaded, target, backend=parent.backend, python=parent.python,
                     mlflow_run_id=parent.mlflow_run_id, parent_run=Path(run))
    if parent.backend == "slurm":
        try:
            run_chain(loaded, info, progress=lambda message: progress(f"eval@{target.name}: {message}"),
                      eval_only=True)
        except BaseException:
            layout.unpin(checkpoint, owner=target)  # nothing will export it
            raise
    else:
        progress(f"eval@{target.name}: asked for; `embodyhpc submit` runs it beside training")
    return target


def hook(run: Path, config: Config) -> Callable[[int, Path], None] | None:
    """The checkpointer's on_complete for a training run (None when nothing is evaluated while training)."""
    if not (config.eval.enabled and config.eval.every_k_checkpoints):
        return None

    def on_complete(step: int, folder: Path) -> None:
        if not evaluates_step(config, step):
            return
        try:
            request(Path(run), step, folder, progress=lambda message: print(message, flush=True))
        except Exception:  # the checkpoint is safe and training goes on: say why this step goes unevaluated
            print(f"eval@{layout.step_name(step)}: could not be started; training continues without it:\n"
                  f"{traceback.format_exc()}", flush=True)

    return on_complete
