"""Report plots as PNG files for MLflow and Markdown (matplotlib's Agg renderer, no pyplot; imported lazily).

    plot_task_bars(report, "eval/task_success.png")          # per-task success, Wilson 95% error bars, per policy
    plot_success_vs_step([(1000, 0.2, 0.1, 0.35), (2000, 0.5, 0.36, 0.64)], "eval/success_vs_step.png",
                         references={"expert": 0.98, "random": 0.0})
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from embodyhpc.atomic import replace_atomically
from embodyhpc.eval.aggregate import Report


def _figure(width: float, height: float) -> tuple[Any, Any]:
    # A bare Figure renders through Agg without pyplot: no display, no global figure registry, no backend switch.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    return fig, fig.subplots()


def _save(fig: Any, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, lambda tmp: fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=120,
                                                      bbox_inches="tight"))
    return path


def plot_task_bars(report: Report, path: str | os.PathLike, *, title: str = "Success rate per task") -> Path:
    """One group of bars per task (and "overall" for several tasks), one bar per policy, Wilson 95% error bars.
    Tasks with missing episodes get a "*" and the bar's recorded/planned count; a task without records no bar."""
    rows = [*report.tasks, *(["overall"] if len(report.tasks) > 1 else [])]
    policies = list(report.policies.items())
    width = 0.8 / max(len(policies), 1)
    fig, ax = _figure(max(4.0, 0.9 * len(rows) * max(1, len(policies)) ** 0.5 + 2), 3.6)
    for i, (name, policy) in enumerate(policies):
        stats = [policy.overall if row == "overall" else policy.tasks[row] for row in rows]
        xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(rows))]
        heights = [s.success_rate or 0.0 for s in stats]
        errors = [[h - s.ci_low if s.recorded else 0 for h, s in zip(heights, stats, strict=True)],
                  [s.ci_high - h if s.recorded else 0 for h, s in zip(heights, stats, strict=True)]]
        ax.bar(xs, heights, width, yerr=errors, capsize=2, label=name)
        for x, s in zip(xs, stats, strict=True):
            if not s.complete:
                ax.annotate(f"{s.recorded}/{s.planned}", (x, 1.02), ha="center", fontsize=6, color="red")
    labels = [row if row == "overall" or all(p.tasks[row].complete for _, p in policies) else f"{row}*"
              for row in rows]
    ax.set_xticks(range(len(rows)), labels, rotation=45 if len(rows) > 4 else 0, ha="right" if len(rows) > 4
                  else "center", fontsize=8)
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("success rate (Wilson 95%)")
    ax.set_title(title + ("" if report.complete else " (INCOMPLETE)"))
    if policies:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_success_vs_step(points: Sequence[tuple[float, float, float, float]], path: str | os.PathLike, *,
                         label: str = "trained", references: Mapping[str, float] | None = None,
                         title: str = "Success rate vs training step") -> Path:
    """points: (step, rate, low, high) per evaluated checkpoint; references: horizontal lines (e.g. expert)."""
    ordered = sorted(points)
    fig, ax = _figure(5.5, 3.6)
    if ordered:
        steps, rates, lows, highs = zip(*ordered, strict=True)
        ax.fill_between(steps, lows, highs, alpha=0.25, label=f"{label} (Wilson 95%)")
        ax.plot(steps, rates, marker="o", label=label)
    for i, (name, rate) in enumerate((references or {}).items()):
        ax.axhline(rate, linestyle="--", linewidth=1, color=f"C{i + 1}", label=name)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("training step")
    ax.set_ylabel("success rate")
    ax.set_title(title)
    if ordered or references:
        ax.legend(fontsize=8)
    return _save(fig, path)


__all__ = ["plot_task_bars", "plot_success_vs_step"]
