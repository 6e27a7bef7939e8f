"""Errors about datasets on disk: bad input the user fixes (exit code 2 through the CLI)."""

from __future__ import annotations

from embodyhpc.errors import UserError


class DatasetError(UserError):
    """A dataset folder or file is missing, in an unsupported format, or inconsistent."""
