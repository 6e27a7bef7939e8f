"""`embodyhpc data`: record demonstrations (or random episodes) in a simulator as LeRobot v3.0; summarise one."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .options import AsJson

data_app = typer.Typer(no_args_is_help=True, help="Datasets: synthesise demonstrations, inspect.")


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
