"""Terminal views of many runs (`embodyhpc runs`) and of one run's training progress (status, --watch, submit)."""

from __future__ import annotations

import dataclasses
import json
import re

from embodyhpc.runstate import RunListing, RunSummary, TrainProgress

from .table import terminal_width


def format_duration(seconds: float) -> str:
    """45s, 12m, 3h05m, 2d04h: short and still exact enough for an age or an ETA."""
    seconds = max(int(seconds), 0)
    if seconds < 60:
        return f"{seconds}s"
    minutes, secs = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s" if minutes < 10 else f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def progress_text(progress: TrainProgress, *, running: bool) -> str:
    """step 450/600 (75%), loss 0.412, 0.87 s/step, 2402 tokens/s, ETA 2m10s (the ETA only while training runs)."""
    total = progress.total_steps
    parts = [f"step {progress.step}/{total} ({100 * progress.step // total}%)" if total else f"step {progress.step}"]
    if progress.loss is not None:
        parts.append(f"loss {progress.loss:.4g}")
    if progress.step_time_s:
        parts.append(f"{progress.step_time_s:.3g} s/step")
    if progress.tokens_per_s:
        parts.append(f"{progress.tokens_per_s:.0f} tokens/s")
    if running and progress.eta_s is not None:
        parts.append(f"ETA {format_duration(progress.eta_s)}")
    if running and progress.updated_s_ago >= 120:  # a stuck job shows as such
        parts.append(f"last logged {format_duration(progress.updated_s_ago)} ago")
    return ", ".join(parts)


def progress_json(progress: TrainProgress | None) -> dict | None:
    if progress is None:
        return None
    return {**dataclasses.asdict(progress), "eta_s": progress.eta_s}


def runs_text(listing: RunListing, width: int | None = None) -> str:
    """The runs as a table that fits `width` columns (the terminal's): where the full one does not, the success
    loses its episode count, RUN shows the folder name alone (what RUN arguments accept, when no two experiments
    hold the same name), AGE goes (the name holds the start time), then the state its job; names are never cut.
    The sacct note is the caller's, for stderr (listing.note)."""
    from .table import printable

    width = terminal_width() if width is None else width
    rows = listing.rows
    lines = []
    if not rows:
        lines.append("no runs")
    else:
        folders = [row.name.rpartition("/")[2] for row in rows]
        unique = len(set(folders)) == len(folders)
        for compact in range(5):
            names = folders if compact >= 2 and unique else [row.name for row in rows]
            header = ("RUN", "STATE", "STEPS", "SUCCESS", "AGE")[:5 if compact < 3 else 4]
            table = [header] + [tuple(printable(cell) for cell in (
                name, _state_cell(row, job=compact < 4), _steps_cell(row),
                _success_cell(row.success, full=compact < 1),
                format_duration(row.age_s) if row.age_s is not None else "-"))[:len(header)]
                for name, row in zip(names, rows, strict=True)]
            widths = [max(len(r[i]) for r in table) for i in range(len(header))]
            if sum(widths) + 2 * (len(widths) - 1) <= width:
                break
        for r in table:
            lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
        lines += [printable(f"{row.name}: {row.reason}") for row in rows if row.state == "DAMAGED"]
    if listing.unreadable:
        count = len(listing.unreadable)
        lines.append(printable(f"not listed: {count} folder{'s' if count > 1 else ''} you cannot read (other "
                               f"users' private runs; owner{'s' if len(listing.owners) > 1 else ''} "
                               f"{', '.join(listing.owners)})"))
    return "\n".join(lines) + "\n"


def _success_cell(success: str | None, *, full: bool) -> str:
    """The report's headline ("0.85 [0.71, 0.93] (40/40 episodes)"); short: the rate and its interval only."""
    if not success:
        return "-"
    if full:
        return success
    match = re.match(r"\S+( \[[^\]]*\])?", success)
    return match.group(0) if match else success


def _state_cell(row: RunSummary, *, job: bool = True) -> str:
    shown = job and row.job and row.state not in ("COMPLETED", "DAMAGED")
    return f"{row.state} ({row.job})" if shown else row.state


def _steps_cell(row: RunSummary) -> str:
    if row.step is None:
        return f"-/{row.total_steps}" if row.total_steps else "-"
    return f"{row.step}/{row.total_steps}" if row.total_steps else str(row.step)


def runs_json(listing: RunListing) -> str:
    return json.dumps({"note": listing.note, "runs": [dataclasses.asdict(row) for row in listing.rows],
                       "unreadable": listing.unreadable}, indent=2) + "\n"
