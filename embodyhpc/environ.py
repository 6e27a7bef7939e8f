"""Temporarily set environment variables for child processes started inside a `with` block."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


@contextlib.contextmanager
def patched_environ(extra: Mapping[str, str]) -> Iterator[None]:
    """Children started inside the block inherit `extra`; the previous values (or absence) come back after."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
