"""Progress of a staging phase (bytes, files, rate): a rich bar on a terminal, plain lines in a job log.

Slurm job logs are not terminals; there a line every PLAIN_INTERVAL_S keeps the log readable instead of
filling it with redraws.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

PLAIN_INTERVAL_S = 10.0


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def format_rate(num_bytes: float, seconds: float) -> str:
    return f"{format_bytes(num_bytes / seconds if seconds > 0 else 0)}/s"


class Progress:
    """One phase ("copy", "verify"): `advance` from the thread that collects results, then `close`."""

    def __init__(self, label: str, total_bytes: int, total_files: int, *, enabled: bool,
                 stream: TextIO | None = None) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.num_bytes = 0
        self.num_files = 0
        self._stream = stream if stream is not None else sys.stderr
        self._enabled = enabled and (total_bytes > 0 or total_files > 0)
        self._start = time.monotonic()
        self.seconds: float | None = None
        """The phase's duration, fixed when it closes: the closing line's rate and the caller's both divide by it."""
        self._last_line = self._start
        self._rich: Any = None
        if self._enabled and self._stream.isatty():
            self._rich, self._task = _start_rich(label, total_bytes, total_files, self._stream)

    def advance(self, num_bytes: int, num_files: int = 0) -> None:
        self.num_bytes += num_bytes
        self.num_files += num_files
        if not self._enabled:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=num_bytes, files=self._files_text())
            return
        now = time.monotonic()
        if now - self._last_line >= PLAIN_INTERVAL_S:
            self._last_line = now
            self._print(f"{format_bytes(self.num_bytes)} / {format_bytes(self.total_bytes)}, "
                        f"{self._files_text()}, {self._rate()}")

    def close(self) -> None:
        if self.seconds is None:
            self.seconds = time.monotonic() - self._start
        if not self._enabled:
            return
        if self._rich is not None:
            self._rich.stop()
            return
        self._print(f"{format_bytes(self.num_bytes)}, {self._files_text()} in {self.seconds:.1f} s ({self._rate()})")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _files_text(self) -> str:
        return f"{self.num_files}/{self.total_files} files"

    def _rate(self) -> str:
        return format_rate(self.num_bytes, self.seconds if self.seconds is not None else time.monotonic() - self._start)

    def _print(self, text: str) -> None:
        print(f"stage {self.label}: {text}", file=self._stream, flush=True)


def _start_rich(label: str, total_bytes: int, total_files: int, stream: TextIO) -> tuple[Any, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
    from rich.progress import Progress as RichProgress

    bar = RichProgress(TextColumn("[bold]stage {task.description}"), BarColumn(),
                       DownloadColumn(binary_units=True), TextColumn("{task.fields[files]}"),
                       TransferSpeedColumn(), TimeRemainingColumn(), console=Console(file=stream))
    task = bar.add_task(label, total=max(total_bytes, 1), files=f"0/{total_files} files")
    bar.start()
    return bar, task
