"""How a command ends: known exceptions become one line on stderr and an exit code of embodyhpc.errors' (the
README's "Exit codes" table); EMBODYHPC_DEBUG=1 shows the traceback instead."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import typer


def run_to_one_line(command: Callable[[], None]) -> None:
    """Run the command line; a UserError exits 2, a RunFailure or an OSError no command turned into its own line 1,
    Ctrl-C 130, each with one line."""
    from embodyhpc.errors import FAILURE_EXIT_CODE, INTERRUPTED_EXIT_CODE, RunFailure, UserError

    _printable_streams()
    try:
        command()
    except UserError as exc:
        if os.environ.get("EMBODYHPC_DEBUG"):
            raise
        typer.echo(f"error: {_bytes_shown(exc.one_line())}", err=True)
        sys.exit(exc.exit_code)
    except RunFailure as exc:
        if os.environ.get("EMBODYHPC_DEBUG"):
            raise
        typer.echo("error: " + _bytes_shown(" ".join(str(exc).split())), err=True)  # one line, even a tool's
        sys.exit(exc.exit_code)
    except OSError as exc:  # the file and the system's words, where no command said more
        if os.environ.get("EMBODYHPC_DEBUG"):
            raise
        from embodyhpc.rundir import shown

        where = next((shown(os.fsdecode(name)) + ": " for name in (exc.filename, exc.filename2) if name), "")
        typer.echo(f"error: {where}{exc.strerror or exc} (EMBODYHPC_DEBUG=1 shows where)", err=True)
        sys.exit(FAILURE_EXIT_CODE)
    except KeyboardInterrupt:  # Ctrl-C: one line and the shell's convention (128 + SIGINT), no traceback
        if os.environ.get("EMBODYHPC_DEBUG"):
            raise
        typer.echo("interrupted", err=True)
        sys.exit(INTERRUPTED_EXIT_CODE)


def _bytes_shown(line: str) -> str:
    """A path's bytes that are not UTF-8 (sys.argv and os.listdir hold them as lone surrogates) as \\xNN."""
    return line.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _printable_streams() -> None:
    """Paths are bytes: a run folder whose name is not UTF-8 prints as those bytes (as `ls` does) instead of
    crashing a strict UTF-8 stdout (en_US.UTF-8's); on stderr they show as \\xNN."""
    for stream, errors in ((sys.stdout, "surrogateescape"), (sys.stderr, "backslashreplace")):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors=errors)
            except (ValueError, OSError):  # a stream that cannot change now: left as it is
                pass
