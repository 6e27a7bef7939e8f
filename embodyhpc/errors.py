"""Errors a user can act on.

`UserError` and its subclasses are bad input: the CLI prints them on one line and exits 2.
Anything else is a runtime failure (exit 1). Every exit code the project gives a meaning to is here (no torch).
"""

from __future__ import annotations

import signal

BAD_INPUT_EXIT_CODE = 2
FAILURE_EXIT_CODE = 1
STOPPED_EXIT_CODE = 128 + signal.SIGTERM
"""A rank that stopped at a stop signal exits as a SIGTERM death would (Slurm then cancels or requeues the job)."""
REQUEUE_EXIT_CODE = 144
"""Exit status of every rank after a requeue: submitit's own "requeue me" code (its local executor restarts the
tasks on it); under Slurm the job's state is REQUEUED whatever the tasks return."""


class UserError(Exception):
    """Bad input. `where` names the file or override, `key` the recipe key, `fix` what to do."""

    exit_code = BAD_INPUT_EXIT_CODE

    def __init__(self, message: str, *, where: str | None = None, key: str | None = None,
                 fix: str | None = None, related: tuple[str, ...] = ()) -> None:
        self.message = message
        self.related = related  # other keys involved in a cross-section check
        self.where = where
        self.key = key
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        parts = [p for p in (self.where, self.key) if p]
        text = ": ".join([*parts, self.message])
        if self.fix:
            text += f" (fix: {self.fix})"
        return " ".join(text.split())  # one line, always


class ConfigError(UserError):
    """A recipe, site profile or override is wrong."""


class RunDirError(UserError):
    """A run directory is missing or not an embodyhpc run."""


class RunFailure(RuntimeError):
    """A runtime failure the CLI reports on one line with exit code 1 (not bad input)."""

    exit_code = FAILURE_EXIT_CODE


class SlurmError(RunFailure):
    """A Slurm command failed."""
