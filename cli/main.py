"""embodyhpc command line: recipes to rendered sbatch jobs to results.

    embodyhpc recipes list
    embodyhpc render recipes/pi05_fp8.yaml --site example_ib data.root=/data/x site.account=me
    embodyhpc submit recipes/demo_metaworld_cpu.yaml --site local
    embodyhpc status RUN_DIR ; embodyhpc logs RUN_DIR -f ; embodyhpc cancel RUN_DIR

Thin by design: each command parses, calls the library, prints. Heavy imports (omegaconf,
jinja2, submitit; never torch) happen inside the commands that need them, so --help is quick.
Set EMBODYHPC_DEBUG=1 for full tracebacks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Robot-policy training recipes to results on Slurm.")
recipes_app = typer.Typer(no_args_is_help=True, help="Shipped recipes and site profiles.")
app.add_typer(recipes_app, name="recipes")
data_app = typer.Typer(no_args_is_help=True, help="Datasets: synthesise demonstrations, inspect.")
app.add_typer(data_app, name="data")

Recipe = Annotated[str, typer.Argument(help="Recipe file, or the name of a shipped recipe.")]
Overrides = Annotated[list[str] | None, typer.Argument(help="key=value overrides, applied last.")]
Site = Annotated[str | None, typer.Option("--site", "-s", help="Site profile name or file "
                                             "(default: $EMBODYHPC_SITE).")]
RunDir = Annotated[str, typer.Argument(
    metavar="RUN", help="The run: its folder (printed by `embodyhpc submit`), its name as `embodyhpc runs` lists it "
    "(or a unique start of it, or EXPERIMENT/NAME), or `latest`.")]
RunsRoot = Annotated[Path | None, typer.Option(
    "--runs-root", help="Where run names and `latest` are looked up (default: the site profile's job.runs_root, "
    "else ./runs).")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


def _load(recipe: str, overrides: list[str] | None, site: str | None, **options):
    from embodyhpc.config.load import load_recipe

    return load_recipe(recipe, overrides or [], site=site, **options)


def _python(loaded, local: bool = False) -> str:
    """site.python; else the container's python3 for a container site (rendered and submitted jobs), else this
    interpreter (and always this one for --local runs, which use no container)."""
    from embodyhpc.slurm.render import job_python

    return sys.executable if local and not loaded.config.site.python else job_python(loaded.config)


def _run_dir(run: str, site: str | None, runs_root: Path | None) -> Path:
    from embodyhpc.submit import find_run_dir

    return find_run_dir(run, site=site, root=runs_root)


def _check_kind(job: str | None) -> None:
    from embodyhpc.slurm.render import JOB_KINDS

    if job is not None and job not in JOB_KINDS:
        from embodyhpc.errors import UserError

        raise UserError(f"unknown job {job!r}", key="--job", fix=f"use one of {', '.join(JOB_KINDS)}")


@recipes_app.command("list")
def recipes_list() -> None:
    """List shipped recipes and site profiles."""
    from embodyhpc.config.load import shipped_recipes, shipped_sites

    typer.echo("recipes: " + " ".join(shipped_recipes()))
    typer.echo("sites:   " + " ".join(shipped_sites()))


@recipes_app.command("show")
def recipes_show(recipe: Recipe, overrides: Overrides = None, site: Site = None) -> None:
    """Print a recipe fully resolved (defaults, base recipes, site, overrides)."""
    typer.echo(_load(recipe, overrides, site).to_yaml(), nl=False)


@app.command()
def validate(recipe: Recipe, overrides: Overrides = None, site: Site = None) -> None:
    """Check a recipe; print the resolved job shape."""
    from embodyhpc.submit import preflight

    loaded = _load(recipe, overrides, site)
    for warning in preflight(loaded, _python(loaded), submitting=False):
        typer.echo(f"warning: {warning}", err=True)
    r = loaded.resolved
    typer.echo(f"ok: {loaded.recipe}" + (f" + {loaded.site}" if loaded.site else ""))
    typer.echo(f"  train: {loaded.config.resources.nodes} node(s) x {r.procs_per_node} rank(s) = "
               f"world {r.world_size}; dp_replicate={r.dp_replicate} dp_shard={r.dp_shard}; "
               f"grad accumulation {r.grad_accum_steps}; time {r.train_time_min} min")
    typer.echo(f"  eval: {r.num_eval_episodes} episodes in {loaded.config.eval.shards} shards")


@app.command()
def render(
    recipe: Recipe,
    overrides: Overrides = None,
    site: Site = None,
    job: Annotated[str | None, typer.Option(help="Only this job: train, export, eval or report.")] = None,
    run_dir: Annotated[Path | None, typer.Option(help="Run directory to render for "
                                                    "(default: the one submit would create now).")] = None,
) -> None:
    """Print the sbatch scripts exactly as `submit` would hand them to Slurm."""
    from embodyhpc.orchestrate.plan import chain_kinds
    from embodyhpc.slurm.render import render_job
    from embodyhpc.submit import default_run_dir, preflight

    _check_kind(job)
    loaded = _load(recipe, overrides, site)
    for warning in preflight(loaded, _python(loaded), submitting=False):
        typer.echo(f"warning: {warning}", err=True)
    target = run_dir.resolve() if run_dir else default_run_dir(loaded.config.job)
    kinds = [job] if job else chain_kinds(loaded)
    for i, kind in enumerate(kinds):
        if len(kinds) > 1:
            typer.echo(f"{'' if i == 0 else chr(10)}# ===== {kind}.sbatch =====")
        typer.echo(render_job(loaded, kind, target, _python(loaded)), nl=False)


@app.command()
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
        typer.echo(submitting.dry_run(loaded, _python(loaded), progress=lambda msg: typer.echo(msg, err=True)),
                   nl=False)
        return
    say = (lambda msg: typer.echo(msg, err=True)) if as_json else typer.echo
    info = submitting.submit(loaded, _python(loaded, local), local=local, progress=say)
    if info.backend == "local":  # the chain has run: show where it got
        from .status import local_summary

        say(local_summary(Path(info.run_dir)))
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


@app.command("eval")
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
    source = evaluate.resolve_source(_run_dir(ckpt, site, runs_root))
    extra = [f"eval.suite={suite}"] if suite else []
    weights = source.weights or source.checkpoint  # a checkpoint: the chain exports it first
    # the weights' config may come from someone else: its site-only keys (python, templates, container) are
    # dropped, and the site profile given now supplies them
    loaded = _load(str(source.config_path), [*extra, f"eval.weights={weights}", *(overrides or [])], site,
                   recipe_site_keys="drop")
    if source.mlflow_parent:
        say(f"attaching to MLflow run {source.mlflow_parent} of {source.source_run}")
    info = submitting.submit(loaded, _python(loaded, local), local=local, progress=say, eval_only=True,
                             mlflow_parent=source.mlflow_parent)
    _print_run(info, as_json)


@app.command()
def smoke(
    recipe: Annotated[str | None, typer.Argument(help="Recipe whose attention, precision and compile settings to "
                                                    "mark in the table (and, with --submit, whose site and "
                                                    "resources the job uses).")] = None,
    overrides: Overrides = None,
    site: Site = None,
    as_json: AsJson = False,
    submit_job: Annotated[bool, typer.Option("--submit", help="Run it as a one-node job through the site "
                                             "profile instead of here.")] = False,
    steps: Annotated[int, typer.Option(help="Training steps per path.")] = 20,
    size: Annotated[str, typer.Option(help="pi0.5 size: tiny or small.")] = "tiny",
) -> None:
    """Train a few steps on this node through every GPU path the install offers: the first thing to run on a new
    cluster (without a GPU: the CPU references, every GPU row skipped with its reason)."""
    from embodyhpc.errors import RunFailure, UserError

    if size not in ("tiny", "small"):
        raise UserError(f"unknown smoke size {size!r}", key="--size", fix="use --size tiny or --size small")
    if steps < 4:
        raise UserError(f"--steps {steps} is too few to see the loss fall", key="--steps", fix="use --steps 4 or more")
    loaded = _load(recipe, overrides, site) if recipe else None
    if submit_job:
        if loaded is None:
            raise UserError("--submit needs a recipe (its site profile and resources shape the job)", key="--submit",
                            fix="embodyhpc smoke RECIPE --site SITE --submit")
        from embodyhpc import submit as submitting

        info = submitting.submit_smoke(loaded, _python(loaded), steps=steps, size=size,
                                       progress=lambda msg: typer.echo(msg, err=as_json))
        typer.echo(f"  embodyhpc logs {info.run_dir} --job smoke -f    (the table; smoke.json when done)")
        return
    from embodyhpc.train.smoke import format_report, run_smoke

    report = run_smoke(loaded.config if loaded else None, steps=steps, size=size,
                       progress=lambda row: typer.echo(f"{row.path.name}: {row.status}", err=True))
    if as_json:
        import json

        typer.echo(json.dumps({"device": report.device, "ok": report.ok,
                               "rows": [row.as_dict() for row in report.rows]}, indent=2))
    else:
        typer.echo(format_report(report), nl=False)
    if not report.ok:
        raise RunFailure("smoke: a path that ran failed (see its row)")


@app.command()
def status(run: RunDir, as_json: AsJson = False, site: Site = None, runs_root: RunsRoot = None) -> None:
    """State of each job of a run's chain (Slurm state, reason, array progress)."""
    from .status import status_report

    typer.echo(status_report(_run_dir(run, site, runs_root), as_json=as_json), nl=False)


@app.command()
def logs(
    run: RunDir,
    job: Annotated[str | None, typer.Option(help="Only this job: train, export, eval or report.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")] = False,
    site: Site = None,
    runs_root: RunsRoot = None,
) -> None:
    """Print the jobs' stdout/stderr (per task)."""
    from .status import print_logs

    _check_kind(job)
    for line in print_logs(_run_dir(run, site, runs_root), job, follow=follow):
        typer.echo(line)


@app.command()
def cancel(run: RunDir, site: Site = None, runs_root: RunsRoot = None) -> None:
    """Cancel every job of the run's chain."""
    from embodyhpc.orchestrate.api import cancel_run

    typer.echo(cancel_run(_run_dir(run, site, runs_root)))


@app.command()
def stage(
    src: Annotated[Path, typer.Argument(help="Dataset folder on the parallel filesystem.")],
    dest: Annotated[Path, typer.Argument(help="Node-local folder (e.g. on NVMe).")],
    workers: Annotated[int, typer.Option(help="Parallel copy threads.")] = 8,
    verify: Annotated[str, typer.Option(
        "--verify", help="quick: hash while copying, re-hash on restage only files whose stat changed; "
        "full: re-hash the whole staged copy from disk (catches bit rot); none: trust size and mtime.")] = "quick",
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Same as --verify none.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Copy a dataset to node-local storage: parallel, idempotent, resumable, verified."""
    from embodyhpc.staging import stage as stage_dataset

    result = stage_dataset(src, dest, workers=workers, verify="none" if no_verify else verify, progress=not quiet)
    typer.echo(result.summary())


@app.command("export")
def export(
    source: Annotated[Path, typer.Argument(help="An embodyhpc export folder (RUN/export or RUN/exports/step-N).")],
    out: Annotated[Path, typer.Option("--out", help="New folder for the converted weights.")],
    fmt: Annotated[str, typer.Option("--format", help="lerobot: LeRobot's pi05 policy folder "
                                                        "(config.json + model.safetensors).")] = "lerobot",
    execute_steps: Annotated[int, typer.Option(help="n_action_steps of LeRobot's config.")] = 50,
) -> None:
    """Convert an export for another framework: LeRobot's pi0.5 layout, which LeRobot's PI05Policy loads."""
    from embodyhpc.errors import UserError

    if fmt != "lerobot":
        raise UserError(f"unknown format {fmt!r}", key="--format", fix="use --format lerobot")
    if execute_steps < 1:
        raise UserError("must be >= 1", key="--execute-steps")
    from embodyhpc.checkpoint.lerobot_export import export_lerobot

    typer.echo(f"wrote LeRobot's pi0.5 layout to {export_lerobot(source, out, execute_steps=execute_steps)}")


@data_app.command("synth")
def data_synth(
    out: Annotated[Path, typer.Option("--out", help="New LeRobot v3.0 dataset folder.")],
    env: Annotated[str, typer.Option(help="Evaluation suite to record in: metaworld (scripted experts), libero, "
                                          "pusht, or a registered one.")] = "metaworld",
    tasks: Annotated[str, typer.Option(help="Comma-separated tasks; default: 4 MT10 tasks.")] = "",
    episodes: Annotated[int, typer.Option(help="Episodes per task (failed expert ones are dropped).")] = 5,
    image_size: Annotated[int, typer.Option(help="Camera image side in pixels.")] = 64,
    seed: Annotated[int, typer.Option(help="Decides every goal; same seed, same dataset.")] = 0,
    cameras: Annotated[str | None, typer.Option(help="Comma-separated cameras (metaworld: corner, the default; "
                                                     "libero: image,image2); empty: state only (the default of "
                                                     "other suites).")] = None,
    workers: Annotated[int, typer.Option(help="Processes rolling out episodes (metaworld; same dataset for any "
                                              "number).")] = 1,
    policy: Annotated[str, typer.Option(help="expert (the suite's scripted expert) or random (any suite: for "
                                             "pipeline tests, not demonstrations).")] = "expert",
    max_steps: Annotated[int, typer.Option(help="Step limit per episode; 0: the suite's own.")] = 0,
    option: Annotated[list[str] | None, typer.Option("--option", help="A suite option KEY=VALUE, e.g. "
                                                                       "render_quality=fast (repeatable).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing dataset.")] = False,
) -> None:
    """Record episodes in a simulator (state, action, task text, camera video) as LeRobot v3.0: scripted-expert
    demonstrations, or random-policy episodes for suites without an expert."""
    from embodyhpc.errors import UserError

    chosen = [t.strip() for t in tasks.split(",") if t.strip()]
    if cameras is None:
        cameras = "corner" if env == "metaworld" else ""
    camera_list = [c.strip() for c in cameras.split(",") if c.strip()]
    from embodyhpc.eval.references import reference_policy_names

    if policy not in reference_policy_names():
        raise UserError(f"unknown policy {policy!r}", key="--policy",
                        fix=f"use one of: {', '.join(reference_policy_names())}")
    if env == "metaworld" and policy == "expert" and not option and not max_steps:
        from embodyhpc.sim.metaworld import MT10_TASKS, generate_demos

        summary = generate_demos(out, chosen or MT10_TASKS[:4], episodes, image_size=image_size, seed=seed,
                                 overwrite=overwrite, cameras=camera_list, num_workers=workers)
        typer.echo(f"wrote {summary.num_episodes} episodes ({summary.num_frames} frames, "
                   f"{summary.size_bytes / 1e6:.2f} MB) of {summary.num_attempted} attempted to {summary.root} "
                   f"in {summary.wall_s:.0f} s")
        return
    _record_suite(out, env, chosen, episodes, image_size, seed, camera_list, policy, max_steps, option or [],
                  overwrite)


def _record_suite(out: Path, env: str, tasks: list[str], episodes: int, image_size: int, seed: int,
                  cameras: list[str], policy: str, max_steps: int, options: list[str], overwrite: bool) -> None:
    from embodyhpc.errors import UserError
    from embodyhpc.eval.record import record_episodes
    from embodyhpc.eval.references import make_reference_policy, provides
    from embodyhpc.eval.shards import Episode
    from embodyhpc.eval.suites import available_suites, make_suite, suite_option_names

    if env not in available_suites():
        raise UserError(f"unknown simulator {env!r}", key="--env", fix=f"use one of {', '.join(available_suites())}")
    if not tasks:
        raise UserError("name the tasks to record", key="--tasks", fix="e.g. --tasks libero_spatial/0")
    if episodes < 1 or max_steps < 0 or image_size < 1:
        raise UserError("--episodes and --image-size must be >= 1, --max-steps >= 0", key="--episodes")
    parsed: dict[str, str] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or key not in suite_option_names(env):
            raise UserError(f"{item!r} is not an option of the {env} suite", key="--option",
                            fix=f"use KEY=VALUE with KEY one of {', '.join(suite_option_names(env)) or 'none'}")
        parsed[key] = int(value) if value.isdigit() else value
    try:
        suite = make_suite(env, tasks, cameras=cameras, image_size=image_size, **parsed)
    except ValueError as exc:  # the suite's own message names the task, camera or option
        raise UserError(str(exc), where=f"--env {env}") from None
    with suite:
        if not provides(policy, suite):
            raise UserError(f"the {env} suite has no scripted expert", key="--policy",
                            fix="pass --policy random to record random-action episodes (pipeline tests)")
        actor = make_reference_policy(policy, suite)
        plan = [Episode(task, seed, e) for task in suite.tasks for e in range(episodes)]
        summary = record_episodes(suite, plan, actor, out, max_steps=max_steps or None, overwrite=overwrite,
                                  keep_failed=policy == "random")
    typer.echo(f"wrote {summary.num_episodes} {policy} episodes ({summary.num_frames} frames, {summary.successes} "
               f"successful) to {summary.root} in {summary.wall_s:.0f} s")


@data_app.command("info")
def data_info(path: Annotated[Path, typer.Argument(help="LeRobot v3.0 folder or HDF5 file.")],
              as_json: AsJson = False) -> None:
    """Summarise a dataset: format, episodes, frames, fps, tasks, features."""
    from embodyhpc.data.info import dataset_info, format_info

    info = dataset_info(path)
    if as_json:
        import json

        typer.echo(json.dumps(info, indent=2))
    else:
        typer.echo(format_info(info), nl=False)


@app.command()
def doctor(
    recipe: Annotated[str | None, typer.Argument(help="Recipe whose expectations to check against "
                                                    "(GPUs per node, nodes, runs root, NVMe, network).")] = None,
    overrides: Overrides = None,
    site: Site = None,
    as_json: AsJson = False,
    suggest: Annotated[bool, typer.Option("--suggest-network", help="Propose a `network:` section "
                                          "from the RDMA ports found.")] = False,
    probe_mb: Annotated[int, typer.Option(help="NVMe write probe size in MiB (0 skips it).")] = 64,
) -> None:
    """Preflight this node: GPUs (NVML), InfiniBand/RoCE ports, filesystems, NVMe, NCCL environment."""
    from .doctor import doctor_report

    text, code = doctor_report(_load(recipe, overrides, site) if recipe else None, as_json=as_json,
                               suggest=suggest, probe_bytes=probe_mb << 20)
    typer.echo(text, nl=False)
    raise typer.Exit(code)


def main() -> None:
    from embodyhpc.errors import RunFailure, UserError

    try:
        app()
    except UserError as exc:
        if os.environ.get("EMBODYHPC_DEBUG"):
            raise
        typer.echo(f"error: {exc.one_line()}", err=True)
        sys.exit(2)
    except RunFailure as exc:
        if os.environ.get("EMBODYHPC_DEBUG"):
            raise
        typer.echo("error: " + " ".join(str(exc).split()), err=True)  # one line, even for a tool's stderr
        sys.exit(1)


if __name__ == "__main__":
    main()
