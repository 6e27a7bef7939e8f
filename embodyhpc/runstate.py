"""What runs are doing, for the commands that look at them (`runs`, `status`, `status --watch`, `logs -f`,
`submit --local`'s progress line): a run's state from its jobs' states (Slurm's through embodyhpc.slurm, one sacct
for many runs; run.json's for a local chain, INTERRUPTED once the process that ran it is gone), training's progress
and ETA from the metrics file, and the runs under a runs root with their steps, headline success and age."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from embodyhpc.rundir import RUN_JSON, read_report
from embodyhpc.runinfo import RunInfo

RUN_STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "INTERRUPTED", "UNKNOWN",
              "DAMAGED")
"""A run's state in `embodyhpc runs`: its first job (chain order) that has not completed decides, with Slurm's
words for job states; INTERRUPTED: a local chain whose `submit` process is gone; DAMAGED: run.json unreadable.
Slurm's rarer end states (OUT_OF_MEMORY, NODE_FAIL, PREEMPTED, ...) appear as they are."""
INPUT_BOUND_WAIT_FRACTION = 0.1
"""A run whose steps wait for data this share of their time or more is input-bound (`status` says so)."""
TRAINING_KINDS = ("train", "rl")
"""The jobs that train the policy and log its steps (an RL run's rl job: its versions), whose progress status shows."""


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
    data_wait_fraction: float | None = None
    """Whether training is input-bound, at the last log (train/metrics.py): the share of the step spent waiting for
    data, rank 0's video decode ms per sample and the samples/s its DataLoader workers deliver."""
    decode_ms_per_sample: float | None = None
    loader_samples_per_s: float | None = None

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


@dataclass
class RunListing:
    """What `embodyhpc runs` shows: the rows, a note when sacct failed, and the folders this user cannot read."""

    rows: list[RunSummary]
    note: str | None = None
    unreadable: list[str] = field(default_factory=list)
    """EXPERIMENT/NAME (or EXPERIMENT) of the folders under the runs root this user may not read (other users'
    private runs on a shared runs root): not listed, counted."""
    owners: list[str] = field(default_factory=list)
    """Who those folders belong to."""


def train_progress(run_dir: str | Path) -> TrainProgress | None:
    """Training's last logged step, loss, step time, throughput and the planned steps; None before the first log."""
    from embodyhpc.runlogs import read_last_metrics

    line = read_last_metrics(run_dir)
    if line is None:
        return None
    values = line.values
    return TrainProgress(step=line.step, total_steps=planned_steps(run_dir), loss=values.get("loss"),
                         step_time_s=values.get("step_time_s") or None, tokens_per_s=values.get("tokens_per_s"),
                         updated_s_ago=max(time.time() - line.updated, 0.0),
                         data_wait_fraction=_within(values, "data_wait_fraction", 1.0),
                         decode_ms_per_sample=_within(values, "data_decode_ms_per_sample", 1e9),
                         loader_samples_per_s=_within(values, "data_loader_samples_per_s", 1e9))


def _within(values: dict[str, float], key: str, most: float) -> float | None:
    """values[key] when it is a measure this metric can take (0 to `most`); None when absent, or in a file that
    says otherwise (hand-edited, another tool's): status shows nothing rather than nonsense."""
    value = values.get(key)
    return value if value is not None and 0.0 <= value <= most else None


def planned_steps(run_dir: str | Path) -> int | None:
    """train.steps of the run's resolved.yaml, rl.iterations for an RL run (rl.enabled: its policy versions are
    its steps), read with the recipe loader's guards; None when unreadable. The whole config is not built: `runs`
    reads this for every run it lists."""
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
    if not isinstance(data, dict):
        return None
    rl = data.get("rl") if isinstance(data.get("rl"), dict) else {}
    section, key = ("rl", "iterations") if rl.get("enabled") is True else ("train", "steps")
    steps = data[section].get(key) if isinstance(data.get(section), dict) else None
    return steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None


def chain_states(infos: list[RunInfo]) -> tuple[list[list], str | None]:
    """Each run's job states (slurm.status.read_states: one sacct for all of them), with the states of a local
    chain whose `submit` process is gone turned from active to INTERRUPTED (run.json cannot say so itself)."""
    from embodyhpc.slurm.status import ACTIVE, read_states

    statuses, from_disk = read_states(infos)
    out = []
    for info, jobs in zip(infos, statuses, strict=True):
        gone = _driver_gone(info)
        jobs = [dataclasses.replace(s, state="INTERRUPTED", reason=gone) if gone and s.state in ACTIVE else s
                for s in jobs]
        out.append([_with_training_error(info, s) for s in jobs])
    return out, from_disk


def _with_training_error(info: RunInfo, status):
    """A failed training job's reason from the job itself: the one-line error its rank 0 left in
    logs/train_result.json (a data worker's failure, a refused checkpoint), where Slurm only knows an exit code. Used
    when the record is of this job (its Slurm id; a local chain's has none)."""
    import json

    from embodyhpc.rundir import RESULT_FILE

    if status.kind not in TRAINING_KINDS or status.state != "FAILED":
        return status
    try:
        record = json.loads((Path(info.run_dir) / RESULT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return status
    if not isinstance(record, dict) or record.get("status") != "failed" or not isinstance(record.get("error"), str):
        return status
    if record.get("job_id") not in (None, status.job_id):
        return status  # an earlier attempt's record
    return dataclasses.replace(status, reason=record["error"][:500])


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


def list_runs(root: Path, *, experiment: str | None = None, state: str | None = None) -> RunListing:
    """The runs under `root` (scan_runs), newest first, each with its state, steps, headline success and age; a
    note when sacct failed (the states of Slurm runs then come from disk), and the folders this user cannot read
    (skipped and counted: on a shared runs root, other users' private runs). One sacct for all runs."""
    from embodyhpc.errors import RunDirError, UnreadableRunError, UserError

    if state is not None and state.upper() not in RUN_STATES:
        raise UserError(f"unknown state {state!r}", key="--state", fix=f"use one of {', '.join(RUN_STATES)}")
    found = scan_runs(root)
    folders = [p for p in found.runs if experiment is None or p.parent.name == experiment]
    hidden = [p for p in found.unreadable
              if experiment is None or (p.name if p.parent == found.root else p.parent.name) == experiment]
    rows: list[RunSummary] = []
    loaded: list[tuple[RunSummary, RunInfo]] = []
    for folder in folders:
        row = RunSummary(name=f"{folder.parent.name}/{folder.name}", run_dir=str(folder), state="DAMAGED")
        try:
            loaded.append((row, RunInfo.load(folder)))
        except UnreadableRunError:  # run.json private to its owner, in a folder others may enter
            hidden.append(folder)
            continue
        except RunDirError as exc:
            row.reason = exc.one_line()
        rows.append(row)
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
    hidden.sort(key=run_created_key, reverse=True)
    return RunListing(rows, note, [run_label(p, found.root) for p in hidden], sorted({_owner(p) for p in hidden}))


# ---- the run folders under a runs root, and the run a name or `latest` means (submit.find_run) ----
LATEST = "latest"
"""The RUN argument that means your newest run under the runs root."""
_STAMP_RE = re.compile(r"-(\d{8}-\d{6})(?:-(\d+))?$")  # the suffix rundir.new_run_dir gives every run folder


@dataclass
class RunFolders:
    root: Path
    runs: list[Path]
    """Every run folder under `<root>/<experiment>/` (one holding a run.json, even a damaged one), newest first."""
    unreadable: list[Path]
    """Experiment and run folders there this user may not look into (other users' private folders)."""


def scan_runs(runs_root: str | Path) -> RunFolders:
    """The run folders under a runs root, newest first, and the folders there this user cannot read.

    Folders without run.json (a dataset kept under the runs root, a run folder whose submit failed before writing
    it) are not runs. Nothing outside the runs root is listed: a symlinked experiment or run folder that leads out
    of it is skipped. Evaluations under a run's evals/ belong to that run and are not listed apart. A runs root that
    is a file or cannot be read is a one-line UserError; one that does not exist holds no runs."""
    root = Path(os.path.realpath(Path(runs_root).expanduser()))  # realpath: a symlink loop does not raise
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        entries = []  # no run yet
    except NotADirectoryError:
        raise _root_error(root, "is a file, not the folder runs are under" if os.path.isfile(root) else
                          "a part of the path is a file, not a folder") from None
    except OSError as exc:
        from embodyhpc.rundir import owner_note

        note = owner_note(root) if isinstance(exc, PermissionError) else ""
        raise _root_error(root, f"cannot read the runs root: {exc.strerror or exc}{note}") from None
    runs: list[Path] = []
    unreadable: list[Path] = []
    for experiment in _subfolders(entries, root, unreadable):
        try:
            names = os.listdir(experiment)
        except PermissionError:
            unreadable.append(experiment)
            continue
        except OSError:  # vanished while we looked
            continue
        for run in _subfolders([experiment / name for name in names], root, unreadable):
            try:
                (run / RUN_JSON).lstat()
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError:  # someone else's private run folder
                unreadable.append(run)
                continue
            runs.append(run)
    return RunFolders(root, sorted(runs, key=run_created_key, reverse=True), unreadable)


def run_folders(runs_root: str | Path) -> list[Path]:
    """The run folders under a runs root this user can read, newest first (scan_runs)."""
    return scan_runs(runs_root).runs


def _root_error(root: Path, problem: str):
    from embodyhpc.errors import UserError
    from embodyhpc.rundir import shown

    return UserError(problem, where=shown(str(root)), key="runs root",
                     fix="pass --runs-root FOLDER, or set job.runs_root in the site profile")


def _subfolders(entries: list[Path], root: Path, unreadable: list[Path]) -> list[Path]:
    out = []
    for entry in entries:
        try:
            if entry.is_dir() and Path(os.path.realpath(entry)).is_relative_to(root):
                out.append(entry)
        except PermissionError:  # a folder we may list but not enter
            unreadable.append(entry)
        except OSError:
            continue
    return sorted(out)


def run_created_key(run: Path) -> tuple[str, int, float]:
    """Sorts runs by when `submit` made them: the time stamp in the folder name (run.json is rewritten at every
    state change, so its mtime would put an old run that just finished first); the folder's mtime for a renamed
    folder without one."""
    match = _STAMP_RE.search(run.name)
    if match:
        return match.group(1), int(match.group(2) or 0), 0.0
    try:
        mtime = run.stat().st_mtime
    except OSError:
        mtime = 0.0
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(mtime)), 0, mtime


def owned(path: Path) -> bool:
    """Whether this user owns `path` (`latest` on a shared runs root is your newest run, not whoever's)."""
    try:
        return path.stat().st_uid == os.geteuid()
    except OSError:
        return False


def _owner(path: Path) -> str:
    from embodyhpc.rundir import user_name

    try:
        return user_name(path.stat().st_uid)
    except OSError:
        return "?"


def run_label(run: Path, root: Path) -> str:
    """EXPERIMENT/NAME of a run folder under the runs root (EXPERIMENT of an experiment folder)."""
    return str(run.relative_to(root)) if run.is_relative_to(root) else str(run)
