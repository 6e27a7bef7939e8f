"""What each job of a run's chain is doing: from sacct/squeue (slurm) or run.json (local).

A heterogeneous job (the RL job) is one record J in run.json and one row per component (J+0, J+1, ...) in
sacct/squeue: its status is their summary (hetjob.summarise_states), its nodes all of theirs."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from embodyhpc.errors import SlurmError
from embodyhpc.runinfo import RunInfo
from embodyhpc.slurm import commands, hetjob

ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED")
# the worst state of an array wins its summary
_SEVERITY = ("COMPLETED", "PENDING", "REQUEUED", "RUNNING", "COMPLETING", "CANCELLED", "TIMEOUT",
             "PREEMPTED", "OUT_OF_MEMORY", "NODE_FAIL", "FAILED")


@dataclass
class JobStatus:
    kind: str
    job_id: str | None
    state: str
    reason: str | None = None
    exit_code: int | None = None
    nodes: str | None = None
    elapsed: str | None = None
    array_size: int = 0
    array_counts: dict[str, int] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state not in ACTIVE and self.state != "UNKNOWN"


def exit_code_of(text: str) -> int | None:
    code, _, sig = text.partition(":")
    if not code.isdigit():
        return None
    return int(code) if int(code) or not sig.isdigit() else 128 + int(sig) if int(sig) else 0


def array_task_count(job_id: str) -> int:
    """123_[2-5%4] -> 4 elements, 123_7 -> 1."""
    match = re.search(r"_\[([^\]%]*)", job_id)
    if not match:
        return 1
    total = 0
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        total += int(hi) - int(lo) + 1 if hi else 1
    return total


def summarise_array(states: Counter) -> str:
    if not states:
        return "UNKNOWN"
    if states.get("RUNNING"):
        return "RUNNING"
    if set(states) <= {"COMPLETED"}:
        return "COMPLETED"
    if set(states) <= {"PENDING", "COMPLETED", "REQUEUED"}:
        return "PENDING"
    return max(states, key=lambda s: _SEVERITY.index(s) if s in _SEVERITY else len(_SEVERITY))


def _slurm_rows(job_ids: list[str]) -> dict[str, list[dict[str, str]]]:
    """Rows per submitted job id (arrays: one row per element or pending range)."""
    fields = ["JobID", "State", "ExitCode", "Reason", "NodeList", "Elapsed"]
    out = commands.run(["sacct", "--noheader", "--parsable2", "--allocations",
                        f"--jobs={','.join(job_ids)}", f"--format={','.join(fields)}"])
    rows: dict[str, dict[str, str]] = {}
    for line in out.splitlines():
        values = line.split("|")
        if len(values) == len(fields):
            row = dict(zip(fields, values, strict=True))
            row["State"] = (row["State"].split() or ["UNKNOWN"])[0]  # "CANCELLED by 0" -> CANCELLED
            rows[row["JobID"]] = row
    # squeue is fresher for jobs still queued or running (sacct may lag a second)
    live = commands.run(["squeue", "--noheader", f"--jobs={','.join(job_ids)}",
                         "--format=%i|%T|%r|%N"], check=False)
    for line in live.splitlines():
        values = line.split("|")
        if len(values) == 4:
            job_id, state, reason, nodes = values
            row = rows.setdefault(job_id, {"JobID": job_id, "ExitCode": "", "Elapsed": ""})
            row.update(State=state, Reason=reason, NodeList=nodes)
    grouped: dict[str, list[dict[str, str]]] = {j: [] for j in job_ids}
    for job_id, row in rows.items():
        base = job_id.split("_")[0].split(".")[0].split("+")[0]  # an array element, a step, a het component
        if base in grouped:
            grouped[base].append(row)
    return grouped


def chain_status(info: RunInfo) -> list[JobStatus]:
    return chains_status([info])[0]


def chains_status(infos: list[RunInfo]) -> list[list[JobStatus]]:
    return read_states(infos)[0]


def read_states(infos: list[RunInfo]) -> tuple[list[list[JobStatus]], str | None]:
    """chain_status of several runs (a training run and its in-training evaluations) with one sacct and one squeue.

    When sacct fails (no controller or database answers), Slurm runs fall back to the states on disk (run.json;
    UNKNOWN where it holds none) and the second value says why; None when the states are Slurm's."""
    ids = [r.job_id for info in infos if info.backend != "local" for r in info.jobs.values() if r.job_id]
    from_disk = None
    try:
        grouped: dict[str, list[dict[str, str]]] | None = _slurm_rows(ids) if ids else {}
    except SlurmError as exc:
        grouped, from_disk = None, _first_error_line(str(exc))
    return [_chain_status(info, grouped) for info in infos], from_disk


def _first_error_line(text: str) -> str:
    """sacct prints several `sacct: error: ...` lines for one cause: the last says it best, on one line."""
    errors = [line.split("error:", 1)[-1].strip() for line in text.splitlines() if "error" in line]
    return " ".join((errors[-1] if errors else text).split())[:200]


def _chain_status(info: RunInfo, grouped: dict[str, list[dict[str, str]]] | None) -> list[JobStatus]:
    records = list(info.jobs.values())
    if info.backend == "local" or grouped is None:
        return [JobStatus(kind=r.kind, job_id=r.job_id, state=r.state or "UNKNOWN", reason=r.reason,
                          exit_code=r.exit_code, array_size=r.array_size, array_counts=dict(r.array_counts))
                for r in records]
    statuses = []
    for record in records:
        rows = grouped.get(record.job_id or "", [])
        if record.array_size:
            counts: Counter = Counter()
            for row in rows:
                if "_" in row["JobID"]:
                    counts[row["State"]] += array_task_count(row["JobID"])
            parent = next((r for r in rows if r["JobID"] == record.job_id), None)
            if not counts and parent:  # the whole array still pending as one row
                counts[parent["State"]] = record.array_size
            unreported = record.array_size - sum(counts.values())
            if unreported > 0:  # sacct lags a few seconds behind squeue: not done until reported
                counts["PENDING"] += unreported
            reasons = {r["Reason"] for r in rows if r.get("Reason") not in (None, "", "None")}
            codes = [exit_code_of(r["ExitCode"]) for r in rows if r.get("ExitCode")]
            statuses.append(JobStatus(
                kind=record.kind, job_id=record.job_id, state=summarise_array(counts),
                reason=", ".join(sorted(reasons)) or None,
                exit_code=max((c for c in codes if c is not None), default=None),
                array_size=record.array_size, array_counts=dict(counts)))
        elif (count := hetjob.component_count(info.run_dir, record.kind) or 0) > 1 or any(
                hetjob.is_component(row["JobID"]) for row in rows):
            statuses.append(_het_status(record.kind, record.job_id, rows, count))
        else:
            row = rows[0] if rows else {}
            reason = row.get("Reason")
            statuses.append(JobStatus(
                kind=record.kind, job_id=record.job_id, state=row.get("State", "UNKNOWN"),
                reason=None if reason in (None, "", "None") else reason,
                exit_code=exit_code_of(row.get("ExitCode", "")), nodes=row.get("NodeList") or None,
                elapsed=row.get("Elapsed") or None))
    return statuses


def _het_status(kind: str, job_id: str | None, rows: list[dict[str, str]], count: int) -> JobStatus:
    """A heterogeneous job from its components' rows (sacct's and squeue's, one per component J+i). A component of
    the `count` the job has that neither reports yet is UNKNOWN: the job is not finished before it is. Seen on the
    local cluster: around its start and end, sacct names the job `J` alone (no +0) for a moment, the other
    components missing: that row stands for component 0 only until J+0 is reported."""
    by_offset = {hetjob.component_offset(row["JobID"]): row for row in rows if hetjob.is_component(row["JobID"])}
    plain = next((row for row in rows if row["JobID"] == job_id), None)
    if plain is not None and 0 not in by_offset:
        by_offset[0] = plain
    rows = [by_offset[offset] for offset in sorted(by_offset)]
    unreported = max(count - len(rows), 0)
    reasons = [r["Reason"] for r in rows if r.get("Reason") not in (None, "", "None")]
    codes = [c for c in (exit_code_of(r.get("ExitCode", "")) for r in rows) if c is not None]
    nodes = [r["NodeList"] for r in rows if r.get("NodeList") and r["NodeList"] != "None assigned"]
    states = [r["State"] for r in rows] + ["UNKNOWN"] * unreported
    return JobStatus(kind=kind, job_id=job_id, state=hetjob.summarise_states(states),
                     reason=", ".join(dict.fromkeys(reasons)) or None, exit_code=max(codes, default=None),
                     nodes=",".join(dict.fromkeys(nodes)) or None, elapsed=rows[0].get("Elapsed") or None)
