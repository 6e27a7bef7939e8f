"""What the report's plots show, read back from the figure each one draws (not only that a PNG was written): counts
on the bars, a visible 0/n bar, one line per task over steps, the loss values, a contact sheet's frames decoded
from an mp4 written here with known pixel values, and the HTML report's images embedded byte for byte."""

from __future__ import annotations

import base64
import re

import pytest

from tests.helpers import require

require("matplotlib", "track")

from embodyhpc.eval import plots  # noqa: E402
from embodyhpc.eval.aggregate import RETURN_NOTE, aggregate, html_summary, markdown_summary  # noqa: E402
from embodyhpc.eval.shards import all_episodes  # noqa: E402

TASKS = ["reach-v3", "door-open-v3"]


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions save, in order (the PNGs are still written)."""
    figures = []
    save = plots._save

    def keep(fig, path):
        figures.append(fig)
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def _report():
    """trained: episodes 0-2 of 5 succeed per task (3/5), expert all (5/5), random none (0/5)."""
    plan = all_episodes(TASKS, [0], 5)
    rule = {"trained": lambda e: e.episode < 3, "expert": lambda e: True, "random": lambda e: False}
    records = [{"policy": name, "task": e.task, "seed": e.seed, "episode": e.episode, "success": ok(e),
                "return": 1.0, "length": 10} for name, ok in rule.items() for e in plan]
    return aggregate(records, plan)


def test_bars_carry_their_counts_and_a_zero_bar_is_visible(tmp_path, drawn):
    plots.plot_task_bars(_report(), tmp_path / "bars.png")
    ax = drawn[0].axes[0]
    labels = [t.get_text() for t in ax.texts]
    # 3 groups (2 tasks + overall) x 3 policies, the counts of the rule above
    assert labels == ["3/5", "3/5", "6/10", "5/5", "5/5", "10/10", "0/5", "0/5", "0/10"]
    heights = [bar.get_height() for bar in ax.patches]
    assert heights[:6] == pytest.approx([0.6, 0.6, 0.6, 1.0, 1.0, 1.0])
    assert heights[6:] == [plots.ZERO_MARKER] * 3 and plots.ZERO_MARKER > 0  # drawn, not an empty slot
    assert all(bar.get_edgecolor()[:3] == (0.0, 0.0, 0.0) for bar in ax.patches[6:])  # outlined


def test_task_curves_one_line_per_task_and_none_for_one_step(tmp_path, drawn):
    curves = {"reach-v3": [(400, 0.6), (200, 0.2)], "door-open-v3": [(200, 0.0), (400, 0.4)]}
    assert plots.plot_task_curves(curves, tmp_path / "curves.png").is_file()
    lines = {line.get_label(): list(zip(*line.get_data(), strict=True)) for line in drawn[0].axes[0].lines}
    assert lines == {"reach-v3": [(200, 0.2), (400, 0.6)], "door-open-v3": [(200, 0.0), (400, 0.4)]}
    assert plots.plot_task_curves({"reach-v3": [(200, 0.2)]}, tmp_path / "one.png") is None
    assert not (tmp_path / "one.png").exists()


def test_success_vs_step_has_its_band_and_reference_lines_in_one_picture(tmp_path, drawn):
    points = [(400, 0.6, 0.31, 0.83), (200, 0.2, 0.05, 0.5)]
    plots.plot_success_vs_step(points, tmp_path / "curve.png", references={"expert": 1.0, "random": 0.0})
    ax = drawn[0].axes[0]
    labels = [line.get_label() for line in ax.lines]
    assert labels == ["trained", "expert (1.00)", "random (0.00)"]
    assert [tuple(line.get_ydata()) for line in ax.lines[1:]] == [(1.0, 1.0), (0.0, 0.0)]
    band = ax.collections[0].get_paths()[0].vertices  # fill_between: the low then the high edge
    assert {(round(x), round(y, 2)) for x, y in band} >= {(200, 0.05), (400, 0.31), (200, 0.5), (400, 0.83)}


def test_loss_curve_values(tmp_path, drawn):
    points = [(50, 0.13), (25, 0.5), (75, 0.01)]
    plots.plot_loss(points, tmp_path / "loss.png")
    ax = drawn[0].axes[0]
    assert list(zip(*ax.lines[0].get_data(), strict=True)) == [(25, 0.5), (50, 0.13), (75, 0.01)]
    assert ax.get_yscale() == "log"  # 0.5 / 0.01 spans more than a decade
    assert plots.plot_loss([(25, 0.5)], tmp_path / "short.png") is None


def _video(path, values, size=32):
    av = require("av", "data")
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=5)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for value in values:
            frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), value, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


@pytest.mark.parametrize(("count", "shown"), [(5, [0, 2, 4]), (4, [0, 2, 3]), (2, [0, 1]), (1, [0])])
def test_contact_sheet_frames_are_first_middle_last(count, shown):
    assert plots.sheet_frames(count) == shown


def test_contact_sheet_rows_are_task_and_outcome(tmp_path, drawn, monkeypatch):
    import numpy as np

    def frames(video):  # the decode (slow: torchcodec loads torch) is checked by the test below
        if video.name == "missing.mp4":
            raise RuntimeError("no such file")
        return [np.full((4, 4, 3), value, np.uint8) for value in (10, 20, 30)]

    monkeypatch.setattr(plots, "_frames", frames)
    videos = {("reach-v3", "success"): tmp_path / "s.mp4", ("door-open-v3", "failure"): tmp_path / "missing.mp4"}
    plots.contact_sheet(videos, tmp_path / "sheet.png")
    axes = drawn[0].axes
    assert [ax.get_ylabel() for ax in axes[::3]] == ["door-open-v3\nfailure", "reach-v3\nsuccess"]
    assert [ax.title.get_text() for ax in axes[:3]] == ["first", "middle", "last"]
    assert "unreadable: RuntimeError" in axes[0].texts[0].get_text() and not axes[0].images
    assert [float(ax.images[0].get_array().mean()) for ax in axes[3:]] == [10, 20, 30]


@pytest.mark.slow
def test_contact_sheet_shows_first_middle_last_frame_per_task_and_outcome(tmp_path, drawn):
    require("torchcodec", "data")
    _video(tmp_path / "success.mp4", [20, 60, 100, 140, 180])  # frames 0, 2, 4: gray 20, 100, 180
    _video(tmp_path / "failure.mp4", [200, 200, 30])
    videos = {("reach-v3", "success"): tmp_path / "success.mp4", ("reach-v3", "failure"): tmp_path / "failure.mp4",
              ("door-open-v3", "failure"): tmp_path / "missing.mp4"}
    assert plots.contact_sheet(videos, tmp_path / "sheet.png").is_file()
    axes = drawn[0].axes
    rows = [axes[i:i + 3] for i in range(0, len(axes), 3)]
    assert [row[0].get_ylabel() for row in rows] == ["door-open-v3\nfailure", "reach-v3\nfailure",
                                                     "reach-v3\nsuccess"]
    means = [[float(ax.images[0].get_array().mean()) if ax.images else None for ax in row] for row in rows]
    assert means[0] == [None, None, None] and "unreadable" in rows[0][0].texts[0].get_text()
    assert means[1] == pytest.approx([200, 200, 30], abs=6)  # lossy codec: a few levels off
    assert means[2] == pytest.approx([20, 100, 180], abs=6)
    assert plots.contact_sheet({}, tmp_path / "none.png") is None


def test_the_html_report_embeds_its_images_and_notes_mean_return(tmp_path):
    png = tmp_path / "bars.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    page = html_summary(_report(), notes=["all shards reported"], images={"success per task": png})
    sources = re.findall(r'<img alt="success per task" src="data:image/png;base64,([^"]+)">', page)
    assert [base64.b64decode(s) for s in sources] == [png.read_bytes()]
    assert "<td>trained</td><td>0.60 [0.31, 0.83]</td>" in page  # Wilson(6, 10), as the markdown table says
    assert "<td>reach-v3</td><td>0.60 [0.23, 0.88]</td>" in page
    assert page.count("<table>") == 2 and "<script" not in page
    assert RETURN_NOTE.split(":")[0] in page and "failed episode runs to the step limit" in RETURN_NOTE
    markdown = markdown_summary(_report())
    assert "mean return*" in markdown and RETURN_NOTE in markdown
