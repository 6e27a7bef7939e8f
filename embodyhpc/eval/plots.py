"""Report plots as PNG files for MLflow, W&B and the reports (matplotlib's Agg renderer, no pyplot; imported lazily).

    plot_task_bars(report, "eval/task_success.png")          # per-task success, Wilson 95% error bars, per policy,
                                                              # "k/n" on each bar (a 0/n bar is a visible marker)
    plot_success_vs_step([(1000, 0.2, 0.1, 0.35), (2000, 0.5, 0.36, 0.64)], "eval/success_vs_step.png",
                         references={"expert": 0.98, "random": 0.0})   # None for fewer than two steps
    plot_task_curves({"reach-v3": [(1000, 0.2), (2000, 0.6)]}, "eval/task_success_vs_step.png")
    plot_loss([(25, 0.5), (50, 0.13)], "eval/loss.png")
    contact_sheet({("reach-v3", "success"): Path("x.mp4")}, "eval/contact_sheet.png")  # first/middle/last frame
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


ZERO_MARKER = 0.012
"""Height of the marker drawn for a bar of rate 0 (a 0-height bar would be invisible and read as a rendering bug)."""


def plot_task_bars(report: Report, path: str | os.PathLike, *, title: str = "Success rate per task") -> Path:
    """One group of bars per task (and "overall" for several tasks), one bar per policy, Wilson 95% error bars,
    each bar labelled with its successes/episodes ("3/5"); a rate of 0 is drawn as a thin visible marker labelled
    "0/5". Tasks with missing episodes get a "*" and the bar's label says "(of <planned>)"; a task without records
    no bar."""
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
        drawn = [ZERO_MARKER if s.recorded and h == 0 else h for h, s in zip(heights, stats, strict=True)]
        bars = ax.bar(xs, drawn, width, yerr=errors, capsize=2, label=name)
        for bar, h, s in zip(bars, drawn, stats, strict=True):
            if not s.recorded:
                continue
            label = f"{s.successes}/{s.recorded}" + ("" if s.complete else f" (of {s.planned})")
            top = max(h, s.ci_high)  # above the error bar: the count stays readable
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, top), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=6, color="black" if s.complete else "red")
            if h == ZERO_MARKER:  # the zero bar: an outlined marker in the bar's colour, not an empty slot
                bar.set_edgecolor("black")
                bar.set_linewidth(0.6)
    labels = [row if row == "overall" or all(p.tasks[row].complete for _, p in policies) else f"{row}*"
              for row in rows]
    ax.set_xticks(range(len(rows)), labels, rotation=45 if len(rows) > 4 else 0, ha="right" if len(rows) > 4
                  else "center", fontsize=8)
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("success rate (Wilson 95%)")
    ax.set_title(title + ("" if report.complete else " (INCOMPLETE)"))
    if policies:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_success_vs_step(points: Sequence[tuple[float, float, float, float]], path: str | os.PathLike, *,
                         label: str = "trained", references: Mapping[str, float] | None = None,
                         title: str = "Success rate vs training step") -> Path | None:
    """points: (step, rate, low, high) per evaluated checkpoint, drawn as a line in its Wilson 95% band, with the
    reference policies (e.g. expert, random) as horizontal lines in the same picture. None (no file) for fewer than
    two steps: a single dot is not a curve (the task bars show that evaluation)."""
    ordered = sorted(dict((p[0], p) for p in points).values())  # one point per step: the last reported
    if len(ordered) < 2:
        return None
    fig, ax = _figure(5.5, 3.6)
    steps, rates, lows, highs = zip(*ordered, strict=True)
    ax.fill_between(steps, lows, highs, alpha=0.25, label=f"{label} (Wilson 95%)")
    ax.plot(steps, rates, marker="o", label=label)
    for i, (name, rate) in enumerate((references or {}).items()):
        ax.axhline(rate, linestyle="--", linewidth=1, color=f"C{i + 1}", label=f"{name} ({rate:.2f})")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("training step")
    ax.set_ylabel("success rate")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_task_curves(curves: Mapping[str, Sequence[tuple[float, float]]], path: str | os.PathLike, *,
                     title: str = "Success rate per task vs training step") -> Path | None:
    """One line per task: (step, success rate) at each evaluated checkpoint. None for fewer than two steps."""
    steps = {step for points in curves.values() for step, _ in points}
    if len(steps) < 2:
        return None
    fig, ax = _figure(6.5, 3.6)
    for task, points in curves.items():
        ordered = sorted(dict(points).items())
        ax.plot([p[0] for p in ordered], [p[1] for p in ordered], marker="o", markersize=3, label=task)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("training step")
    ax.set_ylabel("success rate")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_loss(points: Sequence[tuple[float, float]], path: str | os.PathLike, *, key: str = "loss",
              title: str = "Training loss") -> Path | None:
    """The training curve, (step, value); log scale when it spans more than a decade. None without two points."""
    ordered = sorted(dict(points).items())
    if len(ordered) < 2:
        return None
    fig, ax = _figure(5.5, 3.2)
    steps, values = zip(*ordered, strict=True)
    ax.plot(steps, values, linewidth=1)
    if min(values) > 0 and max(values) / min(values) > 10:
        ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel(key)
    ax.set_title(title)
    return _save(fig, path)


def sheet_frames(count: int) -> list[int]:
    """The frames a contact sheet shows of a video of `count` frames: first, middle and last (fewer when short)."""
    if count < 1:
        raise ValueError("a video without frames")
    return list(dict.fromkeys((0, count // 2, count - 1)))


def _frames(video: Path) -> list[Any]:
    """The sheet_frames of an mp4 (HWC uint8), through torchcodec."""
    from torchcodec.decoders import VideoDecoder

    decoder = VideoDecoder(str(video))
    return [decoder[i].permute(1, 2, 0).numpy() for i in sheet_frames(len(decoder))]


def contact_sheet(videos: Mapping[tuple[str, str], Path], path: str | os.PathLike, *,
                  title: str = "Rollouts: first, middle and last frame") -> Path | None:
    """One row per (task, outcome) video: its first, middle and last frame, so rollouts can be judged without
    opening each MP4. None without videos; a video that cannot be read is a row saying so."""
    if not videos:
        return None
    rows = sorted(videos.items())
    fig = _figure(6.0, 1.6 * len(rows) + 0.4)[0]
    fig.clear()
    axes = fig.subplots(len(rows), 3, squeeze=False)
    for row, ((task, outcome), video) in zip(axes, rows, strict=True):
        try:
            frames = _frames(Path(video))
        except Exception as exc:  # noqa: BLE001 - one unreadable video costs its row, not the sheet
            frames, problem = [], f"unreadable: {type(exc).__name__}"
        else:
            problem = ""
        for column, ax in enumerate(row):
            ax.set_xticks([])
            ax.set_yticks([])
            if column < len(frames):
                ax.imshow(frames[column])
            elif column == 0 and problem:
                ax.text(0.5, 0.5, problem, ha="center", va="center", fontsize=7, transform=ax.transAxes)
            if column == 0:
                ax.set_ylabel(f"{task}\n{outcome}", fontsize=7, color="green" if outcome == "success" else "red")
    for column, name in enumerate(("first", "middle", "last")):
        axes[0][column].set_title(name, fontsize=8)
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


__all__ = ["ZERO_MARKER", "contact_sheet", "plot_loss", "plot_success_vs_step", "plot_task_bars",
           "plot_task_curves", "sheet_frames"]
