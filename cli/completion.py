"""Shell completion options that do what they say: `--show-completion [SHELL]` and `--install-completion [SHELL]`.

Typer's own two options are flags: `embodyhpc --show-completion bash` ignores `bash` and asks shellingham which
shell is among the process's first 10 ancestors, so the same command prints fish's script under fish and fails
with "Shell  not supported." where no shell is near (a test runner's workers, make, cron, an IDE). Here a named
shell is the shell; without one, the shell is detected as before, then taken from $SHELL, and where neither tells,
the command stops with one line naming the fix. Typer's callbacks still write the script and install it, so the
completion itself (`_EMBODYHPC_COMPLETE=complete_bash ...`) is Typer's, unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import click
from typer.core import TyperGroup

SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")
NAMES = ("install_completion", "show_completion")


def _detected() -> str | None:
    try:
        import shellingham

        name, _ = shellingham.detect_shell()
        return name.lower()
    except Exception:  # shellingham.ShellDetectionFailure, or no /proc and no ps
        return None


def shell_for(value: str, *, option: str, detect, environ) -> str:
    """The shell a completion option means: the one named, else detect()'s, else $SHELL's (environ's)."""
    from embodyhpc.errors import UserError

    fix = f"name it, e.g. {option} bash; one of: {', '.join(SHELLS)}"
    shell = value.strip().lower() or detect() or os.path.basename(environ.get("SHELL", "")).lower()
    if not shell:
        raise UserError("cannot tell which shell to complete for: no shell among this process's parents and $SHELL "
                        "is unset", where=option, fix=fix)
    if shell not in SHELLS:
        raise UserError(f"shell {shell!r} has no completion", where=option, fix=fix)
    return shell


def _callback(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None or ctx.resilient_parsing:
        return value
    from typer.completion import install_callback, show_callback

    option = param.opts[0]
    shell = shell_for(value, option=option, detect=_detected, environ=os.environ)
    return (show_callback if param.name == "show_completion" else install_callback)(ctx, param, shell)


def _option(name: str, help: str) -> click.Option:
    # is_flag=False with a flag_value: the value is optional (`--show-completion` alone gives "")
    return click.Option([f"--{name.replace('_', '-')}"], is_flag=False, flag_value="", default=None,
                        metavar="[SHELL]", is_eager=True, expose_value=False, callback=_callback, help=help)


OPTIONS = {
    "install_completion": _option("install_completion", "Install completion for SHELL (bash, zsh, fish, powershell, "
                                                        "pwsh; default: the shell this runs in, else $SHELL)."),
    "show_completion": _option("show_completion", "Print the completion script for SHELL (default: the shell this "
                                                  "runs in, else $SHELL), to copy it or customize the installation."),
}


class CompletionGroup(TyperGroup):
    """The root group, with Typer's two completion flags swapped for the options above."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return [OPTIONS.get(param.name or "", param) for param in super().get_params(ctx)]
