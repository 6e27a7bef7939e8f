"""What `embodyhpc eval --ckpt` shows while a chain runs here and when it ends: episodes done of those planned (a
live line: rewritten in place on a terminal, plain lines at most every 10 s elsewhere), then the success table in the
terminal's width (80 columns in a pipe).

    task                     trained                  expert    random
    reach-v3                 0.80 [0.38, 0.96] 4/5    1.00 5/5  0.00 0/5
    all tasks                0.90 [0.70, 0.97] 18/20  ...

The trained policy's cells carry the Wilson 95% interval; the reference rows (evaluated the same way) show rate and
count only, which keeps the table narrow (the report's table and report.md have every interval).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from embodyhpc.submit import ChangePoller

from .table import aligned, terminal_width

TRAINED = "trained"


def _cell(stats: Mapping[str, Any], interval: bool) -> str:
    count = f"{stats.get('successes', 0)}/{stats.get('recorded', 0)}"
    missing = stats.get("planned", 0) - stats.get("recorded", 0)
    if stats.get("success_rate") is None:
        text = f"n/a {count}"
    elif interval:
        text = f"{stats['success_rate']:.2f} [{stats['ci_low']:.2f}, {stats['ci_high']:.2f}] {count}"
    else:
        text = f"{stats['success_rate']:.2f} {count}"
    return text + (f" ({missing} missing)" if missing else "")


def success_table(results: Mapping[str, Any], width: int | None = None) -> str:
    """report.json's results as task rows x policy columns (trained first), the last row all tasks; fits `width`
    (default: the terminal's) by cutting task names first."""
    policies = results.get("policies", {})
    names = sorted(policies, key=lambda name: (name != TRAINED, name))
    tasks: list[str] = []
    for name in names:
        tasks += [task for task in policies[name]["tasks"] if task not in tasks]
    rows = [(task, *(_cell(policies[n]["tasks"][task], n == TRAINED) if task in policies[n]["tasks"] else ""
                     for n in names)) for task in tasks]
    rows.append(("all tasks", *(_cell(policies[n]["overall"], n == TRAINED) for n in names)))
    lines = aligned(("task", *names), rows, width or terminal_width(), squeeze=0)
    return "\n".join(line for row in lines for line in row)


def episodes_done(run_dir: Path) -> int:
    """Episodes the shards of `run_dir` have recorded (a shard file appears whole when its episodes are done)."""
    from embodyhpc.rundir import shard_files

    done = 0
    for path in shard_files(run_dir):
        try:
            done += sum(1 for line in path.read_text().splitlines() if line.strip())
        except OSError:  # replaced while read: counted on the next poll
            continue
    return done


def planned_episodes(config: Any) -> int:
    """Episodes per policy times the policies (the trained one and the reference rows)."""
    from embodyhpc.eval.shards import all_episodes
    from embodyhpc.eval.suites import make_suite

    ev = config.eval
    with make_suite(ev.suite, list(ev.tasks), **ev.suite_options) as suite:
        tasks = list(suite.tasks)
    return len(all_episodes(tasks, list(ev.seeds), ev.episodes_per_task)) * (1 + len(ev.reference_policies))


class EpisodeProgress(ChangePoller):
    """From its own thread, every `poll_s`: show(f"eval: {done}/{planned} episodes done") once the run folder is
    known (`started`) and whenever the count changed; it stops by itself for a chain submitted to Slurm (`status`
    follows that one)."""

    def __init__(self, config: Any, show: Callable[[str], None], *, poll_s: float = 1.0) -> None:
        self.config, self.show = config, show
        self.run_dir: Path | None = None
        self.planned: int | None = None
        super().__init__(self._look, lambda done: show(f"eval: {done}/{self.planned} episodes done"), poll_s=poll_s,
                         name="eval-progress")

    def started(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)

    def _look(self) -> int | None:
        if self.run_dir is None:
            return None
        if self.planned is None:
            from embodyhpc.runinfo import RunInfo

            if RunInfo.load(self.run_dir).backend != "local":
                raise _NotHere  # submitted to Slurm: nothing to count here
            self.planned = planned_episodes(self.config)
        return episodes_done(self.run_dir)


class _NotHere(Exception):
    """Ends the polling: the chain runs elsewhere."""


RUN_DIRECTORY = "run directory: "
"""How `submit` announces the run folder it created (its progress line): where the watcher starts counting."""


def final_table(run_dir: Path) -> str | None:
    """The success table of a finished evaluation, from its report.json (None before the report job wrote it)."""
    from embodyhpc.rundir import read_report

    report = read_report(run_dir)
    if not report or not report.get("results", {}).get("policies"):
        return None
    return success_table(report["results"])


def watched(config: Any, as_json: bool, submit: Callable[[Callable[[str], None]], Any]) -> Any:
    """`submit(progress)` with a live line of episodes done / planned under its progress lines (stderr with --json),
    counted once the run folder it announces is known; returns what `submit` returned."""
    from .live import LiveLine

    live = LiveLine()
    watch = EpisodeProgress(config, live.show)

    def said(message: str) -> None:
        live.say(message, sys.stderr if as_json else sys.stdout)
        if message.startswith(RUN_DIRECTORY):
            watch.started(Path(message[len(RUN_DIRECTORY):]))

    try:
        with watch:
            return submit(said)
    finally:
        live.close()
