"""`embodyhpc data`: record demonstrations (or random episodes) in a simulator as LeRobot v3.0; summarise one; convert
a LeRobot v2.1 folder to v3.0.

Every option of `data synth` is checked before anything is simulated or written (cli/data_checks.py): a bad one is a
one-line error naming the option and the fix, exit 2, and no folder is made. A recording that fails later (or is
interrupted) removes the folder it was making, and the parent folders it made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .data_checks import MAX_EPISODES_PER_TASK, MAX_IMAGE_SIZE, MAX_STEPS, check_info_path, check_synth, no_half_made
from .options import AsJson

data_app = typer.Typer(no_args_is_help=True, help="Datasets: synthesise demonstrations, inspect, convert.")


@data_app.command("synth")
def data_synth(
    out: Annotated[str, typer.Option("--out", metavar="PATH", help="New LeRobot v3.0 dataset folder (a new path or "
                                     "an empty folder; parent folders are made).")],
    env: Annotated[str, typer.Option(help="Evaluation suite to record in: metaworld (scripted experts), libero, "
                                          "pusht, or a registered one.")] = "metaworld",
    tasks: Annotated[str | None, typer.Option(help="Comma-separated tasks, each once (metaworld: task names, MT10, "
                                                   "MT50); default: 4 MT10 tasks (metaworld).")] = None,
    episodes: Annotated[int, typer.Option(help=f"Episodes per task, 1 to {MAX_EPISODES_PER_TASK} (failed expert ones "
                                               "are dropped).")] = 5,
    image_size: Annotated[int, typer.Option(help=f"Camera image side in pixels: even (yuv420p video), 2 to "
                                                 f"{MAX_IMAGE_SIZE}.")] = 64,
    seed: Annotated[int, typer.Option(help="Decides every goal, 0 to 2147483647; same seed, same dataset.")] = 0,
    cameras: Annotated[str | None, typer.Option(help="Comma-separated cameras, each once (metaworld: corner, the "
                                                     "default; libero: image,image2); empty: state only (the default "
                                                     "of other suites).")] = None,
    workers: Annotated[int, typer.Option(help="Processes rolling out episodes (metaworld; same dataset for any "
                                              "number; capped at this process's CPUs).")] = 1,
    policy: Annotated[str, typer.Option(help="expert (the suite's scripted expert) or random (any suite: for "
                                             "pipeline tests, not demonstrations).")] = "expert",
    max_steps: Annotated[int, typer.Option(help=f"Step limit per episode, up to {MAX_STEPS}; 0: the suite's "
                                                "own.")] = 0,
    option: Annotated[list[str] | None, typer.Option("--option", help="A suite option KEY=VALUE, e.g. "
                                                                       "render_quality=fast (repeatable).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing dataset.")] = False,
) -> None:
    """Record episodes in a simulator (state, action, task text, camera video) as LeRobot v3.0: scripted-expert
    demonstrations, or random-policy episodes for suites without an expert."""
    request = check_synth(out=out, env=env, tasks=tasks, episodes=episodes, image_size=image_size, seed=seed,
                          cameras=cameras, workers=workers, policy=policy, max_steps=max_steps, options=option or [],
                          overwrite=overwrite)
    for warning in request.warnings:
        typer.echo(f"warning: {warning}", err=True)
    with no_half_made(request.out):
        if request.metaworld_expert:
            from embodyhpc.sim.metaworld import generate_demos

            summary = generate_demos(request.out, request.tasks, episodes, image_size=image_size, seed=seed,
                                     overwrite=overwrite, cameras=request.cameras, num_workers=request.workers)
            typer.echo(f"wrote {summary.num_episodes} episodes ({summary.num_frames} frames, "
                       f"{summary.size_bytes / 1e6:.2f} MB) of {summary.num_attempted} attempted to {summary.root} "
                       f"in {summary.wall_s:.0f} s")
            return
        _record_suite(request.out, env, request.tasks, episodes, image_size, seed, request.cameras, policy,
                      max_steps, request.options, overwrite)


def _record_suite(out: Path, env: str, tasks: list[str], episodes: int, image_size: int, seed: int,
                  cameras: list[str], policy: str, max_steps: int, options: dict[str, int | str],
                  overwrite: bool) -> None:
    from embodyhpc.data.writer import NoEpisodesError
    from embodyhpc.errors import RunFailure, UserError
    from embodyhpc.eval.record import record_episodes
    from embodyhpc.eval.references import make_reference_policy, provides
    from embodyhpc.eval.shards import Episode
    from embodyhpc.eval.suites import make_suite

    try:
        suite = make_suite(env, tasks, cameras=cameras, image_size=image_size, **options)
    except (ValueError, TypeError) as exc:  # the suite's own message names the task, camera or option
        raise UserError(" ".join(str(exc).split()), where=f"--env {env}") from None
    with suite:
        if not provides(policy, suite):
            if policy == "expert":
                raise UserError(f"the {env} suite has no scripted expert", key="--policy",
                                fix="pass --policy random to record random-action episodes (pipeline tests)")
            raise UserError(f"the {env} suite cannot run the {policy} policy here", key="--policy",
                            fix="pass --policy random, or give the suite what that policy needs (--option)")
        actor = make_reference_policy(policy, suite)
        plan = [Episode(task, seed, e) for task in suite.tasks for e in range(episodes)]
        try:
            summary = record_episodes(suite, plan, actor, out, max_steps=max_steps or None, overwrite=overwrite,
                                      keep_failed=policy == "random")
        except NoEpisodesError:  # every episode failed, and failed ones are dropped
            limit = f"{max_steps} steps" if max_steps else "the suite's step limit"
            raise RunFailure(f"none of the {len(plan)} {policy} episodes succeeded within {limit}: nothing written; "
                             "raise --max-steps (or leave it out for the suite's own limit)") from None
    typer.echo(f"wrote {summary.num_episodes} {policy} episodes ({summary.num_frames} frames, {summary.successes} "
               f"successful) to {summary.root} in {summary.wall_s:.0f} s")


@data_app.command("info")
def data_info(path: Annotated[str, typer.Argument(metavar="PATH", help="LeRobot v3.0 or v2.1 folder, or HDF5 "
                                                                        "file.")],
              as_json: AsJson = False) -> None:
    """Summarise a dataset: format, episodes, frames, fps, tasks, features."""
    from embodyhpc.data.info import dataset_info, format_info

    info = dataset_info(check_info_path(path))
    if as_json:
        import json

        typer.echo(json.dumps(info, indent=2))
    else:
        typer.echo(format_info(info), nl=False)


@data_app.command("convert")
def data_convert(
    src: Annotated[str, typer.Argument(metavar="SRC", help="LeRobot v2.1 dataset folder (read only).")],
    out: Annotated[str, typer.Option("--out", metavar="DST", help="New LeRobot v3.0 dataset folder (a new path or an "
                                     "empty folder; parent folders are made).")],
    to: Annotated[str, typer.Option("--to", metavar="VERSION", help="Codebase version to write: v3.0.")] = "v3.0",
) -> None:
    """Rewrite a LeRobot v2.1 dataset as LeRobot v3.0 with the same values: data rows as stored, each camera's
    episode videos joined without re-encoding, task indices kept, statistics with quantiles. v2.1 folders are also
    read directly; convert for v3.0's fewer, larger files and quantile normalisation."""
    from embodyhpc.data.convert import CONVERT_TARGETS, check_convert_output, check_convert_source, convert_v21_to_v30
    from embodyhpc.errors import UserError

    if to not in CONVERT_TARGETS:
        raise UserError(f"cannot convert to {to!r}", key="--to", fix=f"choose {', '.join(CONVERT_TARGETS)}")
    check_convert_source(check_info_path(src))
    check_convert_output(out)
    summary = convert_v21_to_v30(src, out)
    typer.echo(f"wrote {summary.num_episodes} episodes ({summary.num_frames} frames, {summary.video_files} video "
               f"files, {summary.size_bytes / 1e6:.2f} MB) as LeRobot v3.0 to {summary.root} in {summary.wall_s:.1f} s")
