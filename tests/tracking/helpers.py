"""Shared by the sqlite and http tests: files a report job uploads, and a child run logged from another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def report_files(tmp_path: Path) -> tuple[Path, Path]:
    """A PNG-named file and a folder with two videos and a markdown summary."""
    plot = tmp_path / "success.png"
    plot.write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    videos = tmp_path / "videos"
    videos.mkdir()
    (videos / "ep0.mp4").write_bytes(os.urandom(256))
    (videos / "ep1.mp4").write_bytes(os.urandom(256))
    (videos / "summary.md").write_text("# report\n")
    return plot, videos


def child_run_in_subprocess(uri: str, parent_run_id: str, step: int, plot: Path, videos: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.tracking.workers", uri, parent_run_id, str(step), str(plot), str(videos)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["pid"] != os.getpid()
    return out


def check_child_run(uri: str, parent_run_id: str, child_run_id: str, step: int) -> None:
    """The child is nested under the parent, in its experiment, with metrics at `step` and every artifact."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    child, parent = client.get_run(child_run_id), client.get_run(parent_run_id)
    assert child.data.tags["mlflow.parentRunId"] == parent_run_id
    assert child.info.experiment_id == parent.info.experiment_id
    assert child.info.status == "FINISHED"
    assert child.data.tags["kind"] == "eval"
    assert child.data.params == {"eval.suite": "metaworld", "eval.tasks": '["reach-v3"]'}
    history = client.get_metric_history(child_run_id, "success_rate")
    assert [(m.step, m.value) for m in history] == [(step, 0.75)]
    assert {f.path for f in client.list_artifacts(child_run_id)} == {"plots", "videos"}
    assert [f.path for f in client.list_artifacts(child_run_id, "plots")] == ["plots/success.png"]
    videos = {f.path: f.file_size for f in client.list_artifacts(child_run_id, "videos")}
    assert videos == {"videos/ep0.mp4": 256, "videos/ep1.mp4": 256, "videos/summary.md": 9}


def local_run_folder(run: Path, recipe: str, overrides: list[str], *, mlflow_run_id: str, jobs: dict) -> Path:
    """A run folder of the local backend as `submit` leaves it (resolved.yaml of `recipe` with `overrides`,
    run.json with `jobs` and MLflow run `mlflow_run_id`), for the report job to read."""
    from embodyhpc.rundir import make_run_dir, write_private
    from embodyhpc.runinfo import RunInfo
    from embodyhpc.validation import load_recipe

    loaded = load_recipe(recipe, overrides, site="local")
    assert make_run_dir(run)
    write_private(run / "resolved.yaml", loaded.to_yaml())
    RunInfo(run_id=run.name, run_dir=str(run), backend="local", recipe=recipe, site=loaded.site, overrides=[],
            python=sys.executable, created="2026-01-01T00:00:00+0000", mlflow_run_id=mlflow_run_id,
            jobs=jobs).save()
    return run
