"""embodyhpc command line: recipes to rendered sbatch jobs to results.

    embodyhpc recipes list
    embodyhpc render recipes/pi05_fp8.yaml --site example_ib data.root=/data/x site.account=me
    embodyhpc submit recipes/demo_metaworld_cpu.yaml --site local
    embodyhpc runs ; embodyhpc status latest --watch ; embodyhpc logs RUN -f ; embodyhpc cancel RUN
    embodyhpc resume RUN [--nodes N] [train.steps=M] [--exclude NODES]

Thin by design: each command parses, calls the library, prints. Heavy imports (omegaconf,
jinja2, submitit; never torch) happen inside the commands that need them, so --help is quick.
Set EMBODYHPC_DEBUG=1 for full tracebacks.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from .completion import CompletionGroup
from .data import data_app
from .options import AsJson, Overrides, Recipe, RunDir, RunsRoot, Site

# -h as well as --help (sub-commands inherit it); a help screen wide enough that option help is not squeezed
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}
# cls: `--show-completion bash` / `--install-completion bash` use the shell they name (cli/completion.py)
app = typer.Typer(cls=CompletionGroup, no_args_is_help=True, add_completion=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None,
                  context_settings=CONTEXT, help="Robot-policy training recipes to results on Slurm.\n\n"
                  "A RECIPE is a YAML file or a shipped recipe's name (`embodyhpc recipes list`); OVERRIDES are "
                  "key=value, applied last, e.g. train.steps=100 resources.nodes=2. A RUN is a run folder, a run "
                  "name (`embodyhpc runs`) or `latest`. EMBODYHPC_DEBUG=1 shows tracebacks.")
recipes_app = typer.Typer(no_args_is_help=True, help="Shipped recipes and site profiles.")
app.add_typer(recipes_app, name="recipes", short_help="Shipped recipes and site profiles: list, show.")
app.add_typer(data_app, name="data", short_help="Datasets: record demonstrations, summarise one.")


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"embodyhpc {version('embodyhpc')}")
        except PackageNotFoundError:  # a source tree that was never installed
            typer.echo("embodyhpc (not installed: no version)")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", "-V", is_eager=True, callback=_version,
                                                help="Print the version and exit.")] = False) -> None:
    pass



def _load(recipe: str, overrides: list[str] | None, site: str | None, **options):
    from embodyhpc.validation import load_recipe

    return load_recipe(recipe, overrides or [], site=site, **options)


def _python(loaded, local: bool = False) -> str:
    """site.python; else the container's python3 for a container site (rendered and submitted jobs), else this
    interpreter (and always this one for --local runs, which use no container)."""
    from embodyhpc.slurm.render import job_python

    return sys.executable if local and not loaded.config.site.python else job_python(loaded.config)


def _run_dir(run: str, site: str | None, runs_root: Path | None) -> Path:
    from embodyhpc.submit import find_run_dir

    return find_run_dir(run, site=site, root=runs_root)


def _check_kind(job: str | None, extra: tuple[str, ...] = ()) -> None:
    from embodyhpc.slurm.render import JOB_KINDS

    kinds = tuple(dict.fromkeys((*JOB_KINDS, *extra)))
    if job is not None and job not in kinds:
        from embodyhpc.errors import UserError

        raise UserError(f"unknown job {job!r}", key="--job", fix=f"use one of {', '.join(kinds)}")


@recipes_app.command("list", short_help="List shipped recipes and site profiles.")
def recipes_list() -> None:
    """List shipped recipes and site profiles."""
    from embodyhpc.config.load import shipped_recipes, shipped_sites

    typer.echo("recipes: " + " ".join(shipped_recipes()))
    typer.echo("sites:   " + " ".join(shipped_sites()))


@recipes_app.command("show", short_help="Print a recipe fully resolved.")
def recipes_show(recipe: Recipe, overrides: Overrides = None, site: Site = None) -> None:
    """Print a recipe fully resolved (defaults, base recipes, site, overrides). Values it leaves `???` (yours to set)
    are shown as `???` and named on stderr."""
    from embodyhpc.config.load import UNREAD
    from embodyhpc.errors import ConfigError

    missing: list[str] = []
    while True:  # each `???` key in turn, until the rest loads (a recipe has a handful at most)
        try:
            text = _load(recipe, overrides, site, unread=tuple(missing)).to_yaml()
            break
        except ConfigError as exc:
            if not exc.message.startswith("missing value") or not exc.key or exc.key in missing:
                raise
            missing.append(exc.key)
    lines = []
    for line in text.splitlines():  # the placeholder stands where the value goes: the recipe's own `???` again
        head, sep, value = line.rpartition(": ")
        lines.append(f"{head}{sep}???  # must be set" if sep and value.strip("'\"") == UNREAD else line)
    typer.echo("\n".join(lines) + "\n", nl=False)
    if missing:
        typer.echo(f"note: {', '.join(missing)}: yours to set (??? above), e.g. "
                   f"{' '.join(f'{key}=...' for key in missing)}", err=True)


@app.command(short_help="Check a recipe; print the resolved job shape.")
def validate(recipe: Recipe, overrides: Overrides = None, site: Site = None) -> None:
    """Check a recipe; print the resolved job shape."""
    from embodyhpc.submit import validate as check

    loaded = _load(recipe, overrides, site)
    for warning in check(loaded, _python(loaded)):
        typer.echo(f"warning: {warning}", err=True)
    r = loaded.resolved
    typer.echo(f"ok: {loaded.recipe}" + (f" + {loaded.site}" if loaded.site else ""))
    rl = loaded.config.rl
    if rl.enabled:  # one heterogeneous job instead of training
        groups = [rl.group(role) for role in ("actor", "rollout", "env")]
        batch = loaded.config.train.global_batch_size  # what a version trains on (rl_schema's docstrings)
        per_version = (f"{batch} samples per version" if rl.async_ else
                       f"{rl.episodes_per_iteration} episodes per version")
        typer.echo(f"  rl: {rl.algorithm}, {'async' if rl.async_ else 'sync'}, {rl.iterations} versions; "
                   + ", ".join(f"{g.role} {g.nodes} node(s) x {g.tasks_per_node} = {g.tasks}" for g in groups)
                   + f" ({groups[2].tasks * rl.envs_per_worker} envs); {per_version}; time {r.train_time_min} min")
    else:
        typer.echo(f"  train: {loaded.config.resources.nodes} node(s) x {r.procs_per_node} rank(s) = "
                   f"world {r.world_size}; dp_replicate={r.dp_replicate} dp_shard={r.dp_shard}; "
                   f"grad accumulation {r.grad_accum_steps}; time {r.train_time_min} min")
    typer.echo(f"  eval: {r.num_eval_episodes} episodes in {loaded.config.eval.shards} shards")


@app.command(short_help="Print the sbatch scripts `submit` would hand to Slurm.")
def render(
    recipe: Recipe,
    overrides: Overrides = None,
    site: Site = None,
    job: Annotated[str | None, typer.Option(help="Only this job: train (rl: an RL recipe's), export, eval or "
                                            "report.")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Run directory to render for "
                                                    "(default: the one submit would create now).")] = None,
) -> None:
    """Print the sbatch scripts exactly as `submit` would hand them to Slurm."""
    from embodyhpc.submit import default_run_dir
    from embodyhpc.submit import render as plan_scripts

    _check_kind(job, extra=("rl",))  # an RL recipe's job
    loaded = _load(recipe, overrides, site)
    target = run_dir.resolve() if run_dir else default_run_dir(loaded.config.job)
    plan = plan_scripts(loaded, _python(loaded), target, job, progress=lambda msg: typer.echo(msg, err=True))
    for i, planned in enumerate(plan.jobs):
        if len(plan.jobs) > 1:
            typer.echo(f"{'' if i == 0 else chr(10)}# ===== {planned.kind}.sbatch =====")
        typer.echo(planned.script, nl=False)


@app.command(short_help="Start a run: train -> eval array -> report (Slurm, or --local).")
def submit(
    recipe: Recipe,
    overrides: Overrides = None,
    site: Site = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Render and check; submit nothing.")] = False,
    local: Annotated[bool, typer.Option("--local", help="Run the chain on this machine, no Slurm.")] = False,
    as_json: AsJson = False,
) -> None:
    """Create a run directory and submit train -> eval array -> report."""
    from embodyhpc import submit as submitting

    loaded = _load(recipe, overrides, site)
    if dry_run:
        planned = submitting.dry_run(loaded, _python(loaded), progress=lambda msg: typer.echo(msg, err=True))
        if as_json:
            import dataclasses
            import json

            typer.echo(json.dumps({"dry_run": True, **dataclasses.asdict(planned)}, indent=2))
        else:
            typer.echo(planned.text(), nl=False)
        return
    from .live import LiveLine
    from .runs import progress_text

    live = LiveLine()  # training's progress on stderr while a chain runs here
    try:
        info = submitting.submit(loaded, _python(loaded, local), local=local,
                                 progress=lambda msg: live.say(msg, sys.stderr if as_json else sys.stdout),
                                 on_train_progress=lambda p: live.show(f"train: {progress_text(p, running=True)}"))
    finally:
        live.close()
    if info.backend == "local":  # the chain has run: show where it got
        from .status import local_summary

        typer.echo(local_summary(Path(info.run_dir)), err=as_json)
    _print_run(info, as_json)


def _print_run(info, as_json: bool) -> None:
    """The run's folder (or its run.json with --json); then, for a chain that ran here, a true exit code: 1 with
    the reason on one line when a job failed or shards are missing."""
    if as_json:
        import dataclasses
        import json

        typer.echo(json.dumps(dataclasses.asdict(info), indent=2))
    else:
        typer.echo(f"run: {info.run_dir}")
        typer.echo(f"  embodyhpc status {info.run_dir}")
    if info.backend == "local":
        from embodyhpc.errors import RunFailure
        from embodyhpc.submit import chain_failure

        why = chain_failure(Path(info.run_dir))
        if why:
            raise RunFailure(why)


@app.command("eval", short_help="Evaluate a checkpoint, an export or a run's weights.")
def eval_cmd(
    ckpt: Annotated[str, typer.Option("--ckpt", help="Export folder, checkpoints/step-N folder, or a run (its "
                                                    "folder, its name, or `latest`).")],
    overrides: Overrides = None,
    suite: Annotated[str | None, typer.Option("--suite", help="Simulator suite (default: the recipe's).")] = None,
    site: Site = None,
    local: Annotated[bool, typer.Option("--local", help="Run on this machine, no Slurm.")] = False,
    as_json: AsJson = False,
    runs_root: RunsRoot = None,
) -> None:
    """Evaluate existing weights: the eval array + report of the training chain, attached to the run's MLflow."""
    from embodyhpc import evaluate
    from embodyhpc import submit as submitting

    say = (lambda msg: typer.echo(msg, err=True)) if as_json else typer.echo
    path = _run_dir(ckpt, site, runs_root)
    with evaluate.source_lock(path, progress=say):  # the training run it reads: no resume or cancel meanwhile
        source = evaluate.resolve_source(path)
        extra = [f"eval.suite={suite}"] if suite else []
        weights = source.weights or source.checkpoint  # a checkpoint: the chain exports it first
        # the weights' config may come from someone else: its site-only keys (python, templates, container) are
        # dropped, and the site profile given now supplies them
        loaded = _load(str(source.config_path), [*extra, f"eval.weights={weights}", *(overrides or [])], site,
                       recipe_site_keys="drop")
        evaluate.check_inputs(source, loaded.config)  # side files, suite, overrides: before anything is created
        if source.mlflow_parent:
            say(f"attaching to MLflow run {source.mlflow_parent} of {source.source_run}")
        from .eval_view import final_table, watched

        info = watched(loaded.config, as_json, lambda said: submitting.submit(  # episodes done / planned
            loaded, _python(loaded, local), local=local, progress=said, eval_only=True,
            mlflow_parent=source.mlflow_parent))
    table = final_table(Path(info.run_dir)) if info.backend == "local" else None
    if table:
        typer.echo(table, err=as_json)
    _print_run(info, as_json)


@app.command(short_help="Train a few steps through every GPU path of this node.")
def smoke(
    recipe: Annotated[str | None, typer.Argument(help="Recipe whose model (model.name; pi05 without a recipe) "
                                                    "to smoke, whose attention, precision and compile settings to "
                                                    "mark in the table (and, with --submit, whose site and "
                                                    "resources the job uses).")] = None,
    overrides: Overrides = None,
    site: Site = None,
    as_json: AsJson = False,
    submit_job: Annotated[bool, typer.Option("--submit", help="Run it as a one-node job through the site "
                                             "profile instead of here.")] = False,
    steps: Annotated[int, typer.Option(help="Training steps per path.")] = 20,
    size: Annotated[str, typer.Option(help="The model's size to smoke, one its spec's smoke entry lists (pi05 tiny "
                                      "or small, groot tiny).")] = "tiny",
) -> None:
    """Train a few steps of the recipe's model (pi0.5 without a recipe) on this node through every GPU path the
    install offers: the first thing to run on a new cluster (without a GPU: the CPU references, every GPU row
    skipped with its reason)."""
    from embodyhpc.errors import RunFailure, UserError

    if steps < 4:
        raise UserError(f"--steps {steps} is too few to see the loss fall", key="--steps", fix="use --steps 4 or more")
    # smoke trains on a fixed synthetic batch: a GPU recipe's `data.root: ???` is no reason to refuse it
    loaded = _load(recipe, overrides, site, unread=("data.root",)) if recipe else None
    model = loaded.config.model.name if loaded else "pi05"
    from embodyhpc.train.smoke import smoke_model

    smoke_model(model, size, where=loaded.recipe if loaded else None)  # refused before anything is submitted
    if submit_job:
        if loaded is None:
            raise UserError("--submit needs a recipe (its site profile and resources shape the job)", key="--submit",
                            fix="embodyhpc smoke RECIPE --site SITE --submit")
        from embodyhpc import submit as submitting

        info = submitting.submit_smoke(loaded, _python(loaded), model=model, steps=steps, size=size,
                                       progress=lambda msg: typer.echo(msg, err=as_json))
        typer.echo(f"  embodyhpc logs {info.run_dir} --job smoke -f    (the table; smoke.json when done)")
        return
    from embodyhpc.train.smoke import format_report, run_smoke

    report = run_smoke(loaded.config if loaded else None, model=model, steps=steps, size=size,
                       progress=lambda row: typer.echo(f"{row.path.name}: {row.status}", err=True))
    if as_json:
        import json

        typer.echo(json.dumps(report.as_dict(), indent=2))
    else:
        typer.echo(format_report(report), nl=False)
    if not report.ok:
        raise RunFailure("smoke: a path that ran failed (see its row)")


from .resume import resume_cmd  # noqa: E402 - the command lives in its own module

app.command("resume", short_help="Continue a stopped run from its newest checkpoint, on any node count.")(resume_cmd)


@app.command(short_help="A run's jobs, training progress and success; --watch until it ends.")
def status(
    run: RunDir,
    as_json: AsJson = False,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Show one progress line (state, step, loss, "
                                        "throughput, ETA) until the run ends, then the status; exit 0 when it "
                                        "completed, 1 when it did not, 130 on Ctrl-C (the run goes on).")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between looks with --watch.")] = 5.0,
    site: Site = None,
    runs_root: RunsRoot = None,
) -> None:
    """State of each job of a run's chain (Slurm state, reason, array progress), training's progress (step, loss,
    throughput, ETA from the metrics file) and the success rates."""
    from .status import status_report

    run_dir = _run_dir(run, site, runs_root)
    if watch:
        if not 0.1 <= interval <= 3600:
            from embodyhpc.errors import UserError

            raise UserError(f"{interval:g} s", key="--interval", fix="use 0.1 to 3600 seconds")
        from .live import LiveLine
        from .status import watch as watch_run

        # the watch is this command's output (stdout), unless stdout is for the JSON at the end
        live = LiveLine(sys.stderr if as_json else sys.stdout, every_s=0.0, stamp=True)
        try:
            code = watch_run(run_dir, interval_s=interval, live=live)
        except KeyboardInterrupt:
            live.close()
            typer.echo(f"stopped watching; the run goes on (embodyhpc status {run})", err=True)
            from embodyhpc.errors import INTERRUPTED_EXIT_CODE

            raise typer.Exit(INTERRUPTED_EXIT_CODE) from None
        typer.echo(status_report(run_dir, as_json=as_json), nl=False)
        raise typer.Exit(code)
    typer.echo(status_report(run_dir, as_json=as_json), nl=False)


@app.command(short_help="List the runs under the runs root: state, steps, success, age.")
def runs(
    experiment: Annotated[str | None, typer.Option("--experiment", "-e", help="Only this experiment's runs.")] = None,
    state: Annotated[str | None, typer.Option(help="Only runs in this state: PENDING, RUNNING, COMPLETED, FAILED, "
                                              "CANCELLED, TIMEOUT, INTERRUPTED, UNKNOWN or DAMAGED.")] = None,
    as_json: AsJson = False,
    site: Site = None,
    runs_root: RunsRoot = None,
) -> None:
    """List the runs under the runs root, newest first: name (what RUN arguments accept), state (Slurm's, or run.json's
    for a local run; the job it is about), training steps done, the trained policy's success with its interval,
    age."""
    from embodyhpc.runstate import list_runs
    from embodyhpc.submit import runs_root as find_root

    from .runs import runs_json, runs_text

    listing = list_runs(find_root(site, runs_root), experiment=experiment, state=state)
    if listing.note and not as_json:  # the JSON holds it; the table on stdout stays a table
        typer.echo(f"note: {listing.note}", err=True)
    typer.echo(runs_json(listing) if as_json else runs_text(listing), nl=False)


@app.command(short_help="Print (or -f follow) the jobs' stdout and stderr.")
def logs(
    run: RunDir,
    job: Annotated[str | None, typer.Option(help="Only this job: train (rl: an RL run's), export, eval or "
                                            "report.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    site: Site = None,
    runs_root: RunsRoot = None,
) -> None:
    """Print the jobs' stdout/stderr (per task)."""
    from .status import print_logs

    _check_kind(job, extra=("rl",))  # an RL run's job
    for line in print_logs(_run_dir(run, site, runs_root), job, follow=follow):
        typer.echo(line)


@app.command(short_help="Cancel every job of a run's chain.")
def cancel(run: RunDir, site: Site = None, runs_root: RunsRoot = None) -> None:
    """Cancel every job of the run's chain."""
    from embodyhpc.orchestrate.api import cancel_run

    typer.echo(cancel_run(_run_dir(run, site, runs_root)))


from .node_tools import doctor, export_cmd, stage  # noqa: E402 - the commands live in their own module

app.command(short_help="Copy a dataset to node-local disk: parallel, resumable, verified.")(stage)
app.command("export", short_help="Convert an export to LeRobot's policy folder.")(export_cmd)
app.command(short_help="Preflight this node (GPUs, network, filesystems) for a recipe.")(doctor)


def main() -> None:
    """The entry point: every exit code is one of embodyhpc.errors' (README, "Exit codes"); cli/exits.py turns known
    exceptions into one line."""
    from .exits import run_to_one_line
    from .options import misplaced_override

    def run() -> None:
        wrong = misplaced_override(sys.argv[1:])
        if wrong is not None:
            from embodyhpc.errors import UserError

            raise UserError("overrides are key=value, e.g. train.steps=100", where=wrong[0],
                            fix=f"write {wrong[1]}")
        app()

    run_to_one_line(run)


if __name__ == "__main__":
    main()
