"""`embodyhpc resume`: parse, call embodyhpc.resume, print (registered by cli/main.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .options import RunDir, RunsRoot


def resume_cmd(
    run: RunDir,
    overrides: Annotated[list[str] | None, typer.Argument(
        help="Values to change, each key=value (e.g. train.steps=2000 resources.nodes=1): resources, parallelism, "
             "train.micro_batch_size, train.steps (raise it to train on), site and staging keys. The global batch "
             "size, model, data and optimizer stay.")] = None,
    site: Annotated[str | None, typer.Option("--site", "-s", help="Site profile to run this attempt with "
                                                                  "(default: the run's own values).")] = None,
    nodes: Annotated[int | None, typer.Option("--nodes", help="Nodes for training (resources.nodes).")] = None,
    exclude: Annotated[str | None, typer.Option("--exclude", help="Nodes no job may run on, comma-separated "
                                                "(added to site.exclude; sbatch --exclude).")] = None,
    local: Annotated[bool, typer.Option("--local", help="Run the chain on this machine, no Slurm.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Check and render; change and submit nothing.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    runs_root: RunsRoot = None,
) -> None:
    """Continue a stopped run in its folder from its newest complete checkpoint, on the same or another number of
    nodes, the same MLflow run going on; evaluation and report follow as after `submit`."""
    from embodyhpc import resume as resuming

    from .main import _print_run, _python, _run_dir

    run_dir = _run_dir(run, site, runs_root)
    extra = [f"resources.nodes={nodes}"] if nodes is not None else []
    if dry_run:
        plan = resuming.plan_resume(run_dir, [*extra, *(overrides or [])], site=site, exclude=exclude)
        typer.echo(resuming.dry_run(plan, _python(plan.loaded)), nl=False)
        typer.echo("")
        return
    say = (lambda msg: typer.echo(msg, err=True)) if as_json else typer.echo
    with resuming.lock_run(run_dir, progress=say) as lock:  # a second resume meanwhile: refused, naming this one
        plan = resuming.plan_resume(run_dir, [*extra, *(overrides or [])], site=site, exclude=exclude, recover=True,
                                    progress=say)
        info = resuming.resume(plan, _python(plan.loaded, local), local=local, progress=say, lock=lock)
    if info.backend == "local":
        from .status import local_summary

        say(local_summary(Path(info.run_dir)))
    _print_run(info, as_json)
