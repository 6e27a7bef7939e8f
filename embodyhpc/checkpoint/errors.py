"""Checkpoint errors: a failed save or load is a runtime failure (exit 1); a wrong folder is bad input (exit 2)."""

from __future__ import annotations

from embodyhpc.errors import RunFailure, UserError


class CheckpointError(RunFailure):
    """A save, load or export failed (on this rank or another: every rank raises, none hangs)."""


class NotACheckpointError(UserError):
    """A folder the user named is not a complete checkpoint."""


def last_line(exc: BaseException, limit: int = 300) -> str:
    """The last non-empty line of an exception's text: DCP's CheckpointException holds every rank's traceback."""
    text = next((line for line in reversed(str(exc).splitlines()) if line.strip()), type(exc).__name__)
    return text.strip()[:limit]
