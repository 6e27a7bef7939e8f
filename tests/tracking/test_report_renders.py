"""The report renders in MLflow: report.html (its plots embedded as data: URIs; MLflow previews HTML, while its
markdown viewer shows images as links) beside report.md, and the plots as MLflow images (log_image key and step:
the run's chart view) on the training run for a point of its curve, on the child run for an `eval --ckpt`."""

from __future__ import annotations

import base64
import json
import re

import pytest

from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.tracking.evaluation import eval_params, log_evaluation
from tests.tracking.test_dashboards import EVAL, results


def _png(path, color):
    from PIL import Image

    Image.new("RGB", (12, 8), color).save(path)
    return path


def _images(client, run_id):
    """{(key, step): the logged PNG's pixels} of a run's MLflow images (artifacts images/<key>+step+<N>+...png)."""
    from PIL import Image

    found = {}
    for item in client.list_artifacts(run_id, "images"):
        name = item.path.split("/", 1)[1]
        if name.endswith(".png") and not name.endswith("compressed.png"):
            key, _, step = name.split("+")[:3]
            local = client.download_artifacts(run_id, item.path)
            with Image.open(local) as image:
                found[(key.replace("~", "/"), int(step))] = image.convert("RGB").tobytes()
    return found


@pytest.mark.parametrize("adhoc", [False, True])
def test_plots_are_mlflow_images_at_the_step_and_the_page_is_kept(sqlite_uri, tmp_path, adhoc):
    from PIL import Image

    training = mr.create_run(sqlite_uri, experiment="demo", run_name="train", status="RUNNING")
    bars, curve = _png(tmp_path / "task_success.png", (255, 0, 0)), _png(tmp_path / "loss.png", (0, 0, 255))
    page = tmp_path / "report.html"
    page.write_text("<html><body><img src='data:image/png;base64,AAAA'></body></html>")
    params = eval_params(EVAL, step=400, weights="/runs/x/exports/step-400", tasks=["reach-v3", "door-open-v3"])
    child = log_evaluation(sqlite_uri, training, step=400, results=results({"reach-v3": (3, 5), "door-open-v3": (5, 5)},
                                                                            5),
                           params=params, outcome="complete", why="all shards reported", summary=None,
                           artifacts=[(page, None)], start_ms=None, end_ms=None, adhoc=adhoc,
                           images={"task_success": bars, "loss": curve}, html=page)
    client = mr.client(sqlite_uri)
    expected = {(f"eval/{name}", 400): Image.open(path).convert("RGB").tobytes()
                for name, path in (("task_success", bars), ("loss", curve))}
    on, off = (child, training) if adhoc else (training, child)
    assert _images(client, on) == expected
    assert _images(client, off) == {}  # an ad-hoc evaluation never draws on the training run
    reports = [f.path for f in client.list_artifacts(training, "reports")]
    assert reports == ([] if adhoc else ["reports/step-400.html"])
    assert "report.html" in {f.path for f in client.list_artifacts(child)}


@pytest.mark.slow  # ~2-4 s: the report job draws every plot
def test_the_report_job_writes_a_self_contained_html_beside_the_markdown(sqlite_uri, tmp_path):
    from embodyhpc.launch.report import report_task
    from embodyhpc.rundir import HISTORY_FILE, METRICS_FILE, PLOTS_DIR, SUMMARY_FILE, shard_file
    from embodyhpc.runinfo import JobRecord
    from tests.tracking.helpers import local_run_folder

    runs_root = mr.sqlite_path(sqlite_uri).parent
    training = mr.create_run(sqlite_uri, experiment="demo", run_name="train", status="RUNNING")
    run = local_run_folder(runs_root / "demo" / "train-1", "recipes/demo_metaworld_cpu.yaml", [
        f"job.runs_root={runs_root}", f"data.root={runs_root}", "eval.reference_policies=[random]",
        "eval.tasks=[reach-v3,door-open-v3]", "eval.episodes_per_task=2", "eval.shards=1"], mlflow_run_id=training,
        jobs={"train": JobRecord("train", job_id="1", state="COMPLETED", exit_code=0),
              "eval": JobRecord("eval", job_id="2", state="COMPLETED", exit_code=0),
              "report": JobRecord("report", job_id="3", state="RUNNING")})
    (run / METRICS_FILE).parent.mkdir(parents=True, exist_ok=True)
    (run / METRICS_FILE).write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (25, 50, 75)))
    (run / "logs" / "train_result.json").write_text('{"status": "completed"}')
    # an evaluation of step 200 while training ran, then this one (step 400): the per-task curve has two steps
    (run / HISTORY_FILE).parent.mkdir(parents=True, exist_ok=True)
    (run / HISTORY_FILE).write_text(json.dumps({"step": 200, "outcome": "complete", "trained": [0.25, 0.05, 0.7],
                                                "tasks": {"reach-v3": 0.5, "door-open-v3": 0.0}}) + "\n")
    for policy, wins in (("trained", {"reach-v3": 2, "door-open-v3": 1}), ("random", {})):
        shard = shard_file(run, policy, 0)
        shard.parent.mkdir(parents=True, exist_ok=True)
        shard.write_text("".join(json.dumps({"policy": policy, "task": task, "seed": 100, "episode": e,
                                             "success": e < wins.get(task, 0), "checkpoint_step": 400}) + "\n"
                                 for task in ("reach-v3", "door-open-v3") for e in range(2)))
    report = report_task(str(run))
    assert report["outcome"] == "complete", report["why"]
    plots = {p.name for p in (run / PLOTS_DIR).iterdir()}
    assert plots == {"task_success.png", "success_vs_step.png", "task_success_vs_step.png", "loss.png"}
    page = (run / SUMMARY_FILE).with_suffix(".html").read_text()
    embedded = [base64.b64decode(d) for d in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]
    assert sorted(embedded) == sorted((run / PLOTS_DIR / name).read_bytes() for name in plots)
    assert "](plots/task_success.png)" in (run / SUMMARY_FILE).read_text()  # the terminal's copy keeps links
    last = json.loads((run / HISTORY_FILE).read_text().splitlines()[-1])
    assert last["tasks"] == {"reach-v3": 1.0, "door-open-v3": 0.5} and last["step"] == 400
    client = mr.client(sqlite_uri)
    child = report["mlflow_child_run_id"]
    assert {"report.html", "report.md"} <= {f.path for f in client.list_artifacts(child)}
    assert client.download_artifacts(child, "report.html") and [f.path for f in client.list_artifacts(
        training, "reports")] == ["reports/step-400.html"]
    keys = {key for key, _ in _images(client, training)}
    assert keys == {f"eval/{name[:-4]}" for name in plots}
    curves = {task: [(m.step, m.value) for m in client.get_metric_history(training, f"eval/{task}/success_rate")]
              for task in ("reach-v3", "door-open-v3")}
    assert curves == {"reach-v3": [(400, 1.0)], "door-open-v3": [(400, 0.5)]}  # this report's point
