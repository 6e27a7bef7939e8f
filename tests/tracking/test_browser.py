"""The MLflow UI in a real browser (headless Chromium from Debian, driven through chromedriver) on a store that
embodyhpc filled as the demo does: the link we print opens the runs table (not MLflow 3's GenAI view), the training
run shows the evaluation metrics, its result table and one success curve per task, report.html is previewed with
its plot drawn, and report.md opens in the artifact viewer with its plot's link into the run.

Found while writing it: MLflow 3.17.2's UI ignores the experiment's `mlflow.experimentKind` tag when choosing its
screens; it follows `workflowType` (the URL, else the browser's last choice, else GenAI). The tag is still set (and
checked over REST in test_dashboards); what makes the difference in this UI is the link (`ui_link`), and this test
fails when the link lacks workflowType=machine_learning.
"""

from __future__ import annotations

import os
import warnings

import pytest

from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.tracking.evaluation import eval_params, log_evaluation
from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink
from tests.tracking import webdriver
from tests.tracking.test_dashboards import EVAL, results

pytestmark = pytest.mark.slow

FRAMES = "return [...document.querySelectorAll('iframe')].map(f => [f.getAttribute('sandbox'), f.src.slice(0, 60)])"
PLOT_COLOUR = (200, 30, 30)


def _plot_pixels(png: bytes) -> int:
    """How many pixels of a screenshot have the test plot's colour (within 3 levels: colour management)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(png)) as shot:
        pixels = shot.convert("RGB").getdata()
    return sum(1 for p in pixels if all(abs(a - b) <= 3 for a, b in zip(p, PLOT_COLOUR, strict=True)))


GENAI_SCREENS = ("Detect Issues", "Token Usage", "Tokens per Trace")


@pytest.fixture(scope="module")
def browser():
    missing = webdriver.available()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the browser test needs Chromium in CI: {missing} (tools/system-deps.sh installs it)")
        warnings.warn(f"SKIPPED the MLflow browser test: {missing}", stacklevel=1)
        pytest.skip(missing)
    with webdriver.Browser() as opened:
        yield opened


def _demo_like_store(uri: str, tmp_path) -> tuple[str, str, str]:
    """A training run with loss curves and two evaluations while training, as `make demo` logs them."""
    run_id = mr.create_run(uri, experiment="browser-demo", run_name=mr.run_display_name(
        "demo-metaworld-20261125-170417", "demo-metaworld"), description="**pi05 (tiny)** on MetaWorld demos")
    sink = MlflowMetricsSink(uri, run_id, prefix="train/", flush_every=100)
    for step in range(50, 650, 50):
        sink.write(step, {"loss": 1.0 / step, "lr": 1e-3})
    sink.flush(force=True)
    from PIL import Image

    from embodyhpc.eval.aggregate import aggregate, html_summary
    from embodyhpc.eval.shards import all_episodes

    plots = tmp_path / "plots"
    plots.mkdir()
    png = plots / "task_success.png"
    Image.new("RGB", (40, 30), PLOT_COLOUR).save(png)
    summary = tmp_path / "report.md"
    summary.write_text("# Evaluation\n\n![task success](plots/task_success.png)\n")
    page = tmp_path / "report.html"  # what the report job writes beside report.md: its plots embedded
    plan = all_episodes(["reach-v3"], [0], 2)
    page.write_text(html_summary(aggregate([{"policy": "trained", "task": e.task, "seed": 0, "episode": e.episode,
                                             "success": True} for e in plan], plan), images={"task success": png}))
    child = None
    for step, rates in [(200, {"reach-v3": (1, 5), "door-open-v3": (2, 5)}),
                        (400, {"reach-v3": (3, 5), "door-open-v3": (5, 5)})]:
        params = eval_params(EVAL, step=step, weights=f"/runs/x/checkpoints/step-{step}",
                             tasks=["reach-v3", "door-open-v3"])
        child = log_evaluation(uri, run_id, step=step, results=results(rates, 5), params=params, outcome="complete",
                               why="all shards reported", summary=summary, artifacts=[(png, "plots"), (page, None)],
                               start_ms=None, end_ms=None, images={"task_success": png}, html=page)
    sink.close("FINISHED")
    return run_id, mr.find_run(uri, run_id)["experiment_id"], child


def test_the_dashboards_open_on_the_runs_and_show_the_evaluation(mlflow_server, tmp_path, browser):
    uri = mlflow_server
    run_id, experiment_id, child = _demo_like_store(uri, tmp_path)

    # (a) the experiment's page opens on the runs table (the UI chooses the tab), with our run in it
    browser.open(mr.ui_link(uri, experiment_id))
    browser.wait_for(lambda: "Run Name" in browser.text() and "170417 demo-metaworld" in browser.text(),
                     what="the runs table")
    assert "/runs" in browser.url()
    assert not [screen for screen in GENAI_SCREENS if screen in browser.text()]

    # (b) the training run shows the evaluation metrics beside the training curves
    browser.open(mr.ui_link(uri, experiment_id, run_id))
    page = browser.wait_for(lambda: "eval/trained/success_rate" in (text := browser.text()) and text,
                            what="the training run's metrics")
    assert "eval/trained/success_ci_low" in page and "train/loss" in page

    # ... the result at a glance (the description's table) and one success curve per task over the steps
    browser.wait_for(lambda: "Result at step 400" in (text := browser.text()) and "eval/reach-v3/success_rate" in text
                     and "eval/door-open-v3/success_rate" in text, what="the headline table and per-task curves")

    # report.md opens in the artifact viewer; MLflow 3.17.2's markdown view shows an image as its link (no inline
    # images), which points at the child run's own plot (served: test_dashboards checks the bytes)
    browser.open(f"{uri}/#/experiments/{experiment_id}/runs/{child}/artifacts/report.md?{mr.ML_WORKFLOW}")
    browser.wait_for(lambda: f"get-artifact?path=plots%2Ftask_success.png&run_uuid={child}" in browser.text(),
                     what="report.md")

    # report.html is previewed with its plot drawn: the plot's 40x30 block of its own colour is on the screen
    browser.open("about:blank")  # the viewer keeps its file on a change of the address's fragment only
    browser.open(f"{uri}/#/experiments/{experiment_id}/runs/{child}/artifacts/report.html?{mr.ML_WORKFLOW}")
    browser.wait_for(lambda: _plot_pixels(browser.screenshot()) >= 40 * 30,
                     what=f"report.html's image (frames: {browser.run(FRAMES)})")
