"""The commands about this node and its files rather than a run: `stage` (a dataset to node-local disk), `export`
(an export to another framework's layout), `doctor` (preflight this node for a recipe). Registered by cli/main.py;
heavy imports inside each command, as there."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .options import AsJson, Overrides, Site


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

    result = stage_dataset(src, dest, workers=workers, verify="none" if no_verify else verify, progress=not quiet,
                           summary=False)  # the bar on stderr; the one summary line on stdout
    typer.echo(result.summary())


def export_cmd(
    source: Annotated[Path, typer.Argument(help="An embodyhpc export folder (RUN/export or RUN/exports/step-N).")],
    out: Annotated[Path, typer.Option("--out", help="New folder for the converted weights.")],
    fmt: Annotated[str, typer.Option("--format", help="lerobot: LeRobot's pi05 policy folder "
                                                        "(config.json + model.safetensors).")] = "lerobot",
    execute_steps: Annotated[int, typer.Option(help="n_action_steps of LeRobot's config.")] = 50,
) -> None:
    """Convert an export for another framework: LeRobot's policy folder in the layout of the model's family (the
    family's spec names its writer: pi0.5's loads as LeRobot's PI05Policy; a family without one is refused)."""
    from embodyhpc.errors import UserError

    if fmt != "lerobot":
        raise UserError(f"unknown format {fmt!r}", key="--format", fix="use --format lerobot")
    if execute_steps < 1:
        raise UserError("must be >= 1", key="--execute-steps")
    from embodyhpc.submit import check_run_path

    check_run_path(str(source))  # someone else's private run, a name too long, a link loop: one line, exit 2
    if not source.is_dir():  # answered before torch loads
        raise UserError("no such export folder", where=str(source), key="SOURCE",
                        fix="pass RUN_DIR/export or RUN_DIR/exports/step-N")
    from embodyhpc.checkpoint.lerobot_export import export_lerobot

    typer.echo(f"wrote LeRobot's policy folder to {export_lerobot(source, out, execute_steps=execute_steps)}")


def doctor(
    recipe: Annotated[str | None, typer.Argument(help="Recipe whose expectations to check against "
                                                    "(GPUs per node, nodes, runs root, NVMe, network).")] = None,
    overrides: Overrides = None,
    site: Site = None,
    as_json: AsJson = False,
    suggest: Annotated[bool, typer.Option("--suggest-network", help="Propose a `network:` section "
                                          "from the RDMA ports found.")] = False,
    probe_mb: Annotated[int, typer.Option(help="NVMe write probe size in MiB (0 skips it).")] = 64,
    local: Annotated[bool, typer.Option("--local", help="Judge for a run on this machine (submit --local; the "
                                        "default when no Slurm controller answers).")] = False,
) -> None:
    """Preflight this node: GPUs (NVML), InfiniBand/RoCE ports, filesystems, NVMe, NCCL environment. With a RECIPE,
    only what it uses is judged: NVMe only when it stages its dataset; a run on this machine needs no shared runs
    root and no network profile."""
    from embodyhpc.validation import load_recipe

    from .doctor import doctor_report, login_node, slurm_reason

    loaded = load_recipe(recipe, overrides or [], site=site) if recipe else None
    if loaded is not None and not local:
        from embodyhpc.slurm.commands import reachable

        answers, why = reachable()
        if not answers:  # where submit would run the chain here, judge it as such
            local = True
            typer.echo(f"note: no Slurm cluster reachable ({slurm_reason(why)}): judged for a run on this machine",
                       err=True)
    login = not local and login_node()  # by hand where jobs are submitted to Slurm, not where they run
    text, code = doctor_report(loaded, as_json=as_json, suggest=suggest, probe_bytes=probe_mb << 20, local=local,
                               login=login)
    typer.echo(text, nl=False)
    raise typer.Exit(code)
