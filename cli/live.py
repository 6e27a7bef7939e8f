"""A live progress line on stderr: rewritten in place on a terminal; elsewhere (a pipe, a job log, CI) plain lines,
at most one per `every_s` and only when the text changed, with no control characters."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import TextIO

PLAIN_EVERY_S = 10.0


class LiveLine:
    def __init__(self, stream: TextIO | None = None, *, every_s: float = PLAIN_EVERY_S,
                 tty: bool | None = None, stamp: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s
        self.stamp = stamp  # each line starts with the time of day (not counted as a change)
        self._lock = threading.Lock()
        self._text = ""  # the progress text shown now (tty), or the last line printed
        self._shown = ""  # tty: that text as drawn (with its stamp)
        self._printed_at = float("-inf")

    def show(self, text: str, *, force: bool = False) -> None:
        """Update the progress line; `force`: print it even if unchanged or sooner than every_s (a last line)."""
        text = " ".join(text.split())  # one line, whatever the parts held
        shown = f"{time.strftime('%H:%M:%S')} {text}" if self.stamp else text
        with self._lock:
            if self.tty:
                width = shutil.get_terminal_size((100, 20)).columns - 1
                self.stream.write("\r\x1b[K" + _printable(shown)[:width])
                self.stream.flush()
                self._text, self._shown = text, shown[:width]
                return
            now = time.monotonic()
            if force and text != self._text or text != self._text and now - self._printed_at >= self.every_s:
                print(_printable(shown), file=self.stream, flush=True)
                self._text, self._printed_at = text, now

    def say(self, text: str, stream: TextIO | None = None) -> None:
        """A line of its own (a job started or ended) without breaking the progress line: on a terminal the
        progress line is cleared, the line printed, and the progress line drawn again below it."""
        with self._lock:
            if self.tty and self._text:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            print(text, file=stream if stream is not None else self.stream, flush=True)
            if self.tty and self._text:
                self.stream.write(self._shown)
                self.stream.flush()

    def close(self) -> None:
        """Leave the last progress text on a line of its own (terminal); elsewhere nothing more is printed."""
        with self._lock:
            if self.tty and self._text:
                self.stream.write("\n")
                self.stream.flush()
                self._text = ""


def _printable(text: str) -> str:
    """No control characters in plain output (a value from a file cannot move the cursor of a log viewer)."""
    return "".join(c if c.isprintable() else "?" for c in text)
