"""Arguments and options several commands share (their help is written once)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer
import typer.core


def _keep_argument_help() -> None:
    """Typer 0.24 stores an argument's help and then calls click's Argument.__init__ without it; click 8.5 sets
    `help` itself, to None, so `--help` would list RECIPE and OVERRIDES undescribed. Store it again afterwards, and
    leave the listing of arguments to Typer's "Arguments" section (click 8.5 would add a second, "Positional
    arguments", once they have help). tests/test_cli_help.py fails if either library changes this."""
    init = typer.core.TyperArgument.__init__
    if getattr(init, "keeps_help", False):
        return
    if hasattr(typer.core.TyperCommand, "format_arguments"):
        typer.core.TyperCommand.format_arguments = lambda self, ctx, formatter: None  # type: ignore[method-assign]

    def keep_help(self, *args, help: str | None = None, **kwargs) -> None:  # noqa: A002 - click's name
        init(self, *args, help=help, **kwargs)
        self.help = help

    keep_help.keeps_help = True  # type: ignore[attr-defined]
    typer.core.TyperArgument.__init__ = keep_help  # type: ignore[method-assign]


_keep_argument_help()

Recipe = Annotated[str, typer.Argument(help="Recipe YAML file, or a shipped recipe's name (`embodyhpc recipes list`).")]
Overrides = Annotated[list[str] | None, typer.Argument(
    help="Recipe values to change, each key=value with a dotted key, applied last: e.g. train.steps=100 "
    "resources.nodes=2 data.root=/data/pick.")]
Site = Annotated[str | None, typer.Option("--site", "-s", help="Site profile name or file "
                                             "(default: $EMBODYHPC_SITE).")]
RunDir = Annotated[str, typer.Argument(
    metavar="RUN", help="The run: its folder (printed by `embodyhpc submit`), its name as `embodyhpc runs` lists it "
    "(or a unique start of it, or EXPERIMENT/NAME), or `latest`.")]
RunsRoot = Annotated[Path | None, typer.Option(
    "--runs-root", help="Where run names and `latest` are looked up (default: the site profile's job.runs_root, "
    "else ./runs).")]
AsJson = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]


# ---- overrides typed the way other tools take them (LeRobot's --train.steps=100, YAML's key: value) ----
OVERRIDE_COMMANDS = ("validate", "render", "submit", "eval", "smoke", "doctor", "show", "resume")
_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)+$")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")


def misplaced_override(args: list[str]) -> tuple[str, str] | None:
    """(the argument, what to write instead) for the first override written another way than key=value: an option
    with a dotted name (`--train.steps=100`, `--train.steps 100`; no option of ours has a dot), `key:value`,
    `key: value`, and `key = value` or `key =value` or `key= value` split across arguments. None when there is none
    (or the command takes no overrides)."""
    if args[:1] == ["recipes"]:
        args = args[1:]
    if not args or args[0] not in OVERRIDE_COMMANDS:
        return None
    for i, arg in enumerate(args):
        nxt = args[i + 1] if i + 1 < len(args) else None
        value_next = nxt is not None and not nxt.startswith("-")
        if arg.startswith("-") and arg != "--":
            name, eq, value = arg.lstrip("-").partition("=")
            if "." in name and _KEY.match(name):
                return arg, f"{name}={value if eq else nxt if value_next else 'VALUE'}"
            continue
        key, colon, value = arg.partition(":")
        if colon and "=" not in arg and _KEY.match(key) and "." in key:
            return arg, f"{key}={value.strip() or (nxt if value_next and not value else 'VALUE')}"
        if arg == "=" and i > 0 and _DOTTED.match(args[i - 1]):
            return f"{args[i - 1]} = {nxt or ''}".strip(), f"{args[i - 1]}={nxt if value_next else 'VALUE'}"
        if arg.startswith("=") and len(arg) > 1 and i > 0 and _DOTTED.match(args[i - 1]):
            return f"{args[i - 1]} {arg}", f"{args[i - 1]}{arg}"
        if arg.endswith("=") and _DOTTED.match(arg[:-1]) and value_next and "=" not in nxt:  # type: ignore[operator]
            return f"{arg} {nxt}", f"{arg}{nxt}"
        if _DOTTED.match(arg) and value_next and "=" not in nxt and not arg.endswith((".yaml", ".yml")) \
                and not Path(arg).exists():  # type: ignore[operator]
            return f"{arg} {nxt}", f"{arg}={nxt}"
    return None
