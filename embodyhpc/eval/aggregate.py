"""Aggregate episode records (the shards' JSONL) into success rates with Wilson 95% intervals, per task and policy.

    from embodyhpc.eval.aggregate import aggregate, format_table, load_records, markdown_summary
    report = aggregate(load_records(run_dir / "eval"), planned=all_episodes(tasks, seeds, episodes_per_task))
    print(format_table(report))

Rates are over the episodes recorded, and every row says how many were planned: an episode of the plan without
a record (a shard that died, a record without an outcome) is listed under `missing`, its task and the overall
row are flagged incomplete, and the table shows "(recorded/planned)" next to the rate. Nothing is silently
averaged over fewer episodes than planned. Records are grouped by their "policy" field, so one report holds the
trained policy and the expert and random reference rows; every policy is held to the same plan.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from embodyhpc.eval.shards import Episode

OVERALL = "overall"


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion; (0, 1) when n == 0 (nothing is known)."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denominator = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denominator
    return max(0.0, center - half), min(1.0, center + half)


@dataclass
class Stats:
    """Outcome of a set of planned episodes (one task, or all tasks) for one policy."""

    planned: int
    recorded: int = 0
    successes: int = 0
    success_rate: float | None = None
    """successes / recorded; None when nothing was recorded."""
    ci_low: float = 0.0
    ci_high: float = 1.0
    mean_return: float | None = None
    mean_length: float | None = None

    @property
    def missing(self) -> int:
        return self.planned - self.recorded

    @property
    def complete(self) -> bool:
        return self.recorded == self.planned

    @classmethod
    def of(cls, records: Sequence[Mapping[str, Any]], planned: int) -> Stats:
        stats = cls(planned=planned, recorded=len(records))
        if records:
            stats.successes = sum(bool(r["success"]) for r in records)
            stats.success_rate = stats.successes / len(records)
            stats.mean_return = _mean(r.get("return") for r in records)
            stats.mean_length = _mean(r.get("length") for r in records)
        stats.ci_low, stats.ci_high = wilson_interval(stats.successes, stats.recorded)
        return stats


def _mean(values: Iterable[Any]) -> float | None:
    numbers = [float(v) for v in values if v is not None]
    return sum(numbers) / len(numbers) if numbers else None


@dataclass
class PolicyReport:
    policy: str
    tasks: dict[str, Stats]
    overall: Stats
    """Pooled over every episode of every task."""
    mean_task_success_rate: float | None
    """Mean of the per-task rates (MetaWorld's usual headline); None unless every task has a record."""
    missing: list[Episode] = field(default_factory=list)
    unplanned: int = 0
    """Records of episodes outside the plan (ignored)."""
    duplicates: int = 0
    """Further records of an episode already recorded (the first one counts)."""
    invalid: int = 0
    """Records without a task/seed/episode/success (ignored; their episodes count as missing)."""

    @property
    def complete(self) -> bool:
        return not self.missing


@dataclass
class Report:
    tasks: list[str]
    planned_per_policy: int
    policies: dict[str, PolicyReport]

    @property
    def complete(self) -> bool:
        return all(p.complete for p in self.policies.values())

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (rates, intervals, missing episodes as [task, seed, episode])."""
        out: dict[str, Any] = {"complete": self.complete, "tasks": self.tasks,
                               "planned_per_policy": self.planned_per_policy, "policies": {}}
        for name, p in self.policies.items():
            out["policies"][name] = {
                "complete": p.complete, "overall": asdict(p.overall),
                "mean_task_success_rate": p.mean_task_success_rate,
                "tasks": {task: asdict(s) for task, s in p.tasks.items()},
                "missing": [[e.task, e.seed, e.episode] for e in p.missing],
                "unplanned": p.unplanned, "duplicates": p.duplicates, "invalid": p.invalid,
            }
        return out


def _key(record: Mapping[str, Any]) -> Episode | None:
    try:
        if not isinstance(record["success"], bool):
            return None
        return Episode(str(record["task"]), int(record["seed"]), int(record["episode"]))
    except (KeyError, TypeError, ValueError):
        return None


def aggregate(records: Iterable[Mapping[str, Any]], planned: Sequence[Episode], *,
              policies: Sequence[str] | None = None) -> Report:
    """Per policy (records' "policy" field), per task and overall statistics against the plan.

    policies: rows to report even without any record (all their episodes then count as missing), in this order;
        policies found only in the records follow in order of appearance.
    """
    plan = list(dict.fromkeys(planned))
    planned_set = set(plan)
    tasks = list(dict.fromkeys(e.task for e in plan))
    by_policy: dict[str, list[Mapping[str, Any]]] = {name: [] for name in policies or ()}
    for record in records:
        by_policy.setdefault(str(record.get("policy", "unknown")), []).append(record)

    reports: dict[str, PolicyReport] = {}
    for name, policy_records in by_policy.items():
        seen: dict[Episode, Mapping[str, Any]] = {}
        unplanned = duplicates = invalid = 0
        for record in policy_records:
            key = _key(record)
            if key is None:
                invalid += 1
            elif key not in planned_set:
                unplanned += 1
            elif key in seen:
                duplicates += 1
            else:
                seen[key] = record
        task_stats = {}
        for task in tasks:
            task_plan = [e for e in plan if e.task == task]
            task_stats[task] = Stats.of([seen[e] for e in task_plan if e in seen], len(task_plan))
        rates = [s.success_rate for s in task_stats.values()]
        reports[name] = PolicyReport(
            policy=name, tasks=task_stats, overall=Stats.of([seen[e] for e in plan if e in seen], len(plan)),
            mean_task_success_rate=None if None in rates or not rates else sum(rates) / len(rates),
            missing=[e for e in plan if e not in seen], unplanned=unplanned, duplicates=duplicates, invalid=invalid)
    return Report(tasks=tasks, planned_per_policy=len(plan), policies=reports)


def load_records(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """Records from JSONL files, or from every *.jsonl file (sorted) in a folder; unfinished *.tmp files are not
    read. A malformed line raises ValueError naming the file and line."""
    if isinstance(paths, (str, os.PathLike)) and Path(paths).is_dir():
        files = sorted(Path(paths).glob("*.jsonl"))
    elif isinstance(paths, (str, os.PathLike)):
        files = [Path(paths)]
    else:
        files = [Path(p) for p in paths]
    records = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON record ({exc})") from exc
    return records


def format_cell(stats: Stats) -> str:
    """"0.80 [0.49, 0.94]"; "(recorded/planned)" appended when episodes are missing."""
    if stats.success_rate is None:
        text = "n/a"
    else:
        text = f"{stats.success_rate:.2f} [{stats.ci_low:.2f}, {stats.ci_high:.2f}]"
    return text if stats.complete else f"{text} ({stats.recorded}/{stats.planned})"


def _rows(report: Report) -> tuple[list[str], list[list[str]]]:
    header = ["task", *report.policies]
    rows = [[task, *(format_cell(p.tasks[task]) for p in report.policies.values())] for task in report.tasks]
    if len(report.tasks) > 1 or not report.policies:
        rows.append([OVERALL, *(format_cell(p.overall) for p in report.policies.values())])
    return header, rows


def _problems(report: Report) -> list[str]:
    lines = []
    for name, p in report.policies.items():
        if p.missing:
            shown = ", ".join(f"{e.task}/{e.seed}/{e.episode}" for e in p.missing[:8])
            more = f" and {len(p.missing) - 8} more" if len(p.missing) > 8 else ""
            lines.append(f"INCOMPLETE {name}: {len(p.missing)} of {p.overall.planned} planned episodes have no "
                         f"record ({shown}{more})")
        for count, what in ((p.unplanned, "outside the plan"), (p.duplicates, "duplicated"),
                            (p.invalid, "without an outcome")):
            if count:
                lines.append(f"note {name}: {count} records {what} were ignored")
    return lines


def format_table(report: Report) -> str:
    """Plain-text table: task rows x policy columns of success rate [Wilson 95%], then what is missing."""
    header, rows = _rows(report)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([*lines, *_problems(report)])


def markdown_summary(report: Report, *, title: str = "Evaluation", images: Mapping[str, str] | None = None,
                     notes: Sequence[str] = ()) -> str:
    """Markdown: status, per-policy overview, task x policy table, problems, then `images` ({caption: path})."""
    status = "complete" if report.complete else "**INCOMPLETE**"
    overview = _overview(report)
    lines = [f"## {title}", "", f"{len(report.tasks)} tasks, {report.planned_per_policy} episodes planned per "
             f"policy: {status}. Success rate with Wilson 95% interval.", *[f"\n{n}" for n in notes], "",
             "| " + " | ".join(OVERVIEW_HEADER) + " |", "|---" * len(OVERVIEW_HEADER) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in overview]
    lines += ["", f"_{RETURN_NOTE}_"]
    header, rows = _rows(report)
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    problems = _problems(report)
    if problems:
        lines += ["", *[f"- {p}" for p in problems]]
    for caption, path in (images or {}).items():
        lines += ["", f"![{caption}]({path})"]
    return "\n".join(lines) + "\n"


OVERVIEW_HEADER = ("policy", "success", "mean over tasks", "episodes", "mean return*", "mean length")
RETURN_NOTE = ("* mean return sums the reward of each episode: a failed episode runs to the step limit and keeps "
               "collecting shaped reward, so a failing policy can out-score the expert. Compare success; mean "
               "length is shorter for a policy that succeeds sooner.")


def _overview(report: Report) -> list[list[str]]:
    out = []
    for name, p in report.policies.items():
        o = p.overall
        mean_task = "n/a" if p.mean_task_success_rate is None else f"{p.mean_task_success_rate:.2f}"
        ret = "n/a" if o.mean_return is None else f"{o.mean_return:.1f}"
        length = "n/a" if o.mean_length is None else f"{o.mean_length:.1f}"
        out.append([name, format_cell(o), mean_task, f"{o.recorded}/{o.planned}", ret, length])
    return out


def html_summary(report: Report, *, title: str = "Evaluation", images: Mapping[str, str | os.PathLike] | None = None,
                 notes: Sequence[str] = ()) -> str:
    """The markdown summary's content as one self-contained HTML page (what MLflow's artifact viewer previews, as
    it does not render a markdown file's images): the tables, then `images` ({caption: PNG file}) embedded as
    data: URIs, so the page needs nothing beside it."""
    import base64
    from html import escape

    def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
        out = ["<table>", "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in header) + "</tr>"]
        out += ["<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows]
        return [*out, "</table>"]

    status = "complete" if report.complete else "<b>INCOMPLETE</b>"
    parts = ["<!DOCTYPE html>", '<html><head><meta charset="utf-8">', f"<title>{escape(title)}</title>",
             "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;margin:.5em 0}"
             "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}img{max-width:100%}"
             ".note{color:#555;font-size:90%}</style></head><body>", f"<h2>{escape(title)}</h2>",
             f"<p>{len(report.tasks)} tasks, {report.planned_per_policy} episodes planned per policy: {status}. "
             "Success rate with Wilson 95% interval.</p>", *[f"<p>{escape(n)}</p>" for n in notes]]
    parts += table(OVERVIEW_HEADER, _overview(report))
    parts.append(f'<p class="note">{escape(RETURN_NOTE)}</p>')
    parts += table(*_rows(report))
    problems = _problems(report)
    if problems:
        parts += ["<ul>", *[f"<li>{escape(p)}</li>" for p in problems], "</ul>"]
    for caption, path in (images or {}).items():
        data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
        parts.append(f'<figure><img alt="{escape(caption)}" src="data:image/png;base64,{data}">'
                     f"<figcaption>{escape(caption)}</figcaption></figure>")
    return "\n".join([*parts, "</body></html>"]) + "\n"


__all__ = ["OVERALL", "PolicyReport", "Report", "Stats", "aggregate", "format_cell", "format_table",
           "html_summary", "load_records", "markdown_summary", "wilson_interval"]
