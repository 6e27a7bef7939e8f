"""Staging errors, each one line: what failed, where, and what to do about it.

Bad arguments (a missing source, overlapping folders, a destination staging does not own) are `UserError`s
(exit code 2 through the CLI). Failures while staging or checking a staged copy are `StagingError`s: runtime
failures (exit code 1) that carry the same `one_line()`.
"""

from __future__ import annotations

from collections.abc import Sequence

from embodyhpc.errors import RunFailure, UserError


class StageInputError(UserError):
    """SRC or DEST is wrong: missing, overlapping, or a non-empty folder that staging did not create."""


class StagingError(RunFailure):
    """Staging failed at run time. `where` names the file or folder, `fix` says what to do."""

    def __init__(self, message: str, *, where: str | None = None, fix: str | None = None) -> None:
        self.message = message
        self.where = where
        self.fix = fix
        super().__init__(self.one_line())

    def one_line(self) -> str:
        text = f"{self.where}: {self.message}" if self.where else self.message
        if self.fix:
            text += f" (fix: {self.fix})"
        return " ".join(text.split())


class NotEnoughSpaceError(StagingError):
    """The destination's filesystem has too little free space for what is still to copy."""


class StagedDataError(StagingError):
    """A staged copy does not match its manifest (damaged, missing or unfinished files): never train on it.

    `problems` lists (relative path, what is wrong) for every file that failed the check.
    """

    def __init__(self, message: str, *, problems: Sequence[tuple[str, str]] = (), where: str | None = None,
                 fix: str | None = None) -> None:
        self.problems = list(problems)
        super().__init__(message, where=where, fix=fix)


class NodeStagingError(StagingError):
    """The local rank that stages for this node failed, stopped, or did not finish in time."""
