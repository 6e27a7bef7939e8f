"""What runs are doing, for the commands that look at them (`runs`, `status`, `status --watch`, `logs -f`,
`submit --local`'s progress line): a run's state from its jobs' states (Slurm's through embodyhpc.slurm, one sacct
for many runs; run.json's for a local chain, INTERRUPTED once the process that ran it is gone), training's progress
and ETA from the metrics file, and the runs under a runs root with their steps, headline success and age."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from embodyhpc.rundir import RunInfo, read_report

RUN_STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "INTERRUPTED", "UNKNOWN",
              "DAMAGED")
"""A run's state in `embodyhpc runs`: its first job (chain order) that has not completed decides, with Slurm's
words for job states; INTERRUPTED: a local chain whose `submit` process is gone; DAMAGED: run.json unreadable.
Slurm's rarer end states (OUT_OF_MEMORY, NODE_FAIL, PREEMPTED, ...) appear as they are."""


@dataclass
class TrainProgress:
    """Where training is, from the metrics file (runlogs.read_last_metrics) and the resolved config."""

    step: int
    total_steps: int | None
    loss: float | None
    step_time_s: float | None
    tokens_per_s: float | None
    updated_s_ago: float
    """Seconds since the metrics file last changed."""

    @property
    def eta_s(self) -> float | None:
        """Time left at the last logged step time; None without one (or with an unknown total)."""
        if self.total_steps is None or not self.step_time_s:
            return None
        return max(self.total_steps - self.step, 0) * self.step_time_s


@dataclass
class RunSummary:
    """One row of `embodyhpc runs`."""

    name: str
    """EXPERIMENT/NAME under the runs root (what RUN arguments accept)."""
    run_dir: str
    state: str
    job: str | None = None
    """The job the state is about (its kind; an array's shards done), None when the chain completed."""
    reason: str | None = None
    step: int | None = None
    total_steps: int | None = None
    success: str | None = None
    """The trained policy's headline success with its interval (the report's), e.g. "0.85 [0.71, 0.93]"."""
    created: str | None = None
    age_s: float | None = None
    backend: str | None = None


def train_progress(run_dir: str | Path) -> TrainProgress | None:
    """Training's last logged step, loss, step time, throughput and the planned steps; None before the first log."""
    from embodyhpc.runlogs import read_last_metrics

    line = read_last_metrics(run_dir)
    if line is None:
        return None
    values = line.values
    return TrainProgress(step=line.step, total_steps=planned_steps(run_dir), loss=values.get("loss"),
                         step_time_s=values.get("step_time_s") or None, tokens_per_s=values.get("tokens_per_s"),
                         updated_s_ago=max(time.time() - line.updated, 0.0))


def planned_steps(run_dir: str | Path) -> int | None:
    """train.steps of the run's resolved.yaml (read with the recipe loader's guards; None when unreadable). The
    whole config is not built: `runs` reads this for every run it lists."""
    import yaml

    from embodyhpc.config.yamlio import MAX_BYTES, load_yaml
    from embodyhpc.rundir import RESOLVED_YAML

    path = Path(run_dir) / RESOLVED_YAML
    try:
        if not path.is_file() or path.stat().st_size > MAX_BYTES:
            return None
        data = load_yaml(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError, yaml.YAMLError):
        return None
    steps = (data.get("train") or {}).get("steps") if isinstance(data, dict) and isinstance(
        data.get("train"), dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def chain_states(infos: list[RunInfo]) -> tuple[list[list], str | None]:
    """Each run's job states (slurm.status.read_states: one sacct for all of them), with the states of a local
    chain whose `submit` process is gone turned from active to INTERRUPTED (run.json cannot say so itself)."""
    from embodyhpc.slurm.status import ACTIVE, read_states

    statuses, from_disk = read_states(infos)
    out = []
    for info, jobs in zip(infos, statuses, strict=True):
        gone = _driver_gone(info)
        out.append([dataclasses.replace(s, state="INTERRUPTED", reason=gone) if gone and s.state in ACTIVE else s
                    for s in jobs])
    return out, from_disk


def _driver_gone(info: RunInfo) -> str | None:
    """Why a local chain is no longer running (its driver process ended), or None (running, another host's, or a
    run.json from before drivers were recorded)."""
    import os
    import socket

    if info.backend != "local" or not info.driver:
        return None
    host, _, pid_text = info.driver.rpartition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"its `embodyhpc submit` (pid {pid}) ended before the chain did"
    except PermissionError:
        pass  # someone's process: ours only if it started before the run (below)
    started = _process_start(pid)
    created = _epoch(info.attempt_created or info.created)  # the newest attempt started its driver
    if started is not None and created is not None and started > created + 2:
        return f"its `embodyhpc submit` (pid {pid}) ended before the chain did (the pid is another process's now)"
    return None


def _process_start(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch), from /proc; None where there is no /proc."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _epoch(created: str) -> float | None:
    from datetime import datetime

    try:
        return datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except ValueError:
        return None


def run_state(statuses: list) -> tuple[str, str | None, str | None]:
    """(state, job, reason) of a run from its jobs' states: the first job in chain order that has not completed
    decides (a failed training is the headline even while the report job records it)."""
    if not statuses:
        return "PENDING", None, "no job submitted yet"
    for s in statuses:
        if s.state != "COMPLETED":
            job = s.kind + (f" {s.array_counts.get('COMPLETED', 0)}/{s.array_size}" if s.array_size else "")
            return s.state, job, s.reason
    return "COMPLETED", None, None


def list_runs(root: Path, *, experiment: str | None = None, state: str | None = None
              ) -> tuple[list[RunSummary], str | None]:
    """The runs under `root` (rundir.run_folders), newest first, each with its state, steps, headline success and
    age; and a note when sacct failed (the states of Slurm runs then come from disk). One sacct for all runs."""
    from embodyhpc.errors import RunDirError, UserError
    from embodyhpc.rundir import run_folders

    if state is not None and state.upper() not in RUN_STATES:
        raise UserError(f"unknown state {state!r}", key="--state", fix=f"use one of {', '.join(RUN_STATES)}")
    if root.exists() and not root.is_dir():
        raise UserError("is a file, not the folder runs are under", where=str(root), key="runs root",
                        fix="pass --runs-root FOLDER, or set job.runs_root in the site profile")
    folders = [p for p in run_folders(root) if experiment is None or p.parent.name == experiment]
    rows: list[RunSummary] = []
    loaded: list[tuple[RunSummary, RunInfo]] = []
    for folder in folders:
        row = RunSummary(name=f"{folder.parent.name}/{folder.name}", run_dir=str(folder), state="DAMAGED")
        rows.append(row)
        try:
            loaded.append((row, RunInfo.load(folder)))
        except RunDirError as exc:
            row.reason = exc.one_line()
    statuses, from_disk = chain_states([info for _, info in loaded])
    for (row, info), jobs in zip(loaded, statuses, strict=True):
        row.state, row.job, row.reason = run_state(jobs)
        row.backend, row.created = info.backend, info.created
        created = _epoch(info.created)
        row.age_s = max(time.time() - created, 0.0) if created is not None else None
        progress = train_progress(folder := Path(info.run_dir))
        row.step, row.total_steps = (progress.step, progress.total_steps) if progress else (None, planned_steps(folder))
        headline = (read_report(folder) or {}).get("headline") or {}
        row.success = headline.get("trained") if isinstance(headline.get("trained"), str) else None
    if state is not None:
        rows = [row for row in rows if row.state == state.upper()]
    note = (f"sacct failed ({from_disk}): the states of Slurm runs come from disk and may be out of date"
            if from_disk is not None else None)
    return rows, note
