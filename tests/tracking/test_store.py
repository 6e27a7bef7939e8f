"""The sqlite store, runs, child runs and reading them back (no server)."""

from __future__ import annotations

import fcntl
import multiprocessing
import shutil
import subprocess
import sys
import threading
import time

import pytest

from embodyhpc.config.schema import TrackingConfig
from embodyhpc.tracking import mlflow_run as mr
from tests.tracking import workers
from tests.tracking.helpers import REPO, check_child_run, child_run_in_subprocess, report_files


def test_modules_do_not_import_mlflow():
    code = ("import sys, embodyhpc.tracking.mlflow_run, embodyhpc.tracking.mlflow_sink\n"
            "from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink\n"
            "MlflowMetricsSink('sqlite:////nonexistent/mlflow.db', 'x')\n"
            "assert 'mlflow' not in sys.modules, 'mlflow imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_tracking_uri_default_is_sqlite_under_runs_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = mr.tracking_uri(TrackingConfig(), "runs")
    assert uri == f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert mr.sqlite_path(uri) == tmp_path / "runs" / "mlflow.db"
    assert mr.artifact_root("runs") == str(tmp_path / "runs" / "mlartifacts")
    site = TrackingConfig(mlflow_uri="http://mlflow.example:5000")
    assert mr.tracking_uri(site, "runs") == "http://mlflow.example:5000"
    assert mr.sqlite_path("http://mlflow.example:5000") is None


@pytest.mark.slow  # two fresh schema migrations: ~2.5 s
def test_init_store_twice_and_default_experiment_beside_db(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow's own default would put artifacts here
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    mr.init_store(uri)
    mr._initialized.clear()  # a second process would not have the in-process memo
    mr.init_store(uri)
    from mlflow import MlflowClient

    default = MlflowClient(tracking_uri=uri).get_experiment("0")
    assert default.artifact_location.startswith(str(tmp_path / "store" / "mlartifacts"))
    assert not (tmp_path / "mlruns").exists()


def test_init_store_http_is_noop():
    mr.init_store("http://127.0.0.1:1")  # nothing to create, nothing contacted
    assert mr.init_lock_path("http://127.0.0.1:1") is None


def test_init_store_waits_for_the_lock(tmp_path, _store_template):
    """Another caller holds the lock (here: this test): init_store returns only after it is released."""
    shutil.copyfile(_store_template, tmp_path / "mlflow.db")  # the up-to-date path (fresh: see the tests below)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    done = threading.Event()
    errors: list[BaseException] = []

    def call() -> None:
        try:
            mr.init_store(uri)
        except BaseException as exc:
            errors.append(exc)
        done.set()

    with open(mr.init_lock_path(uri), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        thread = threading.Thread(target=call)
        thread.start()
        try:
            assert not done.wait(1.5), "init_store returned while the lock was held"
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
        assert done.wait(60)
    thread.join()
    assert errors == []
    from mlflow import MlflowClient

    assert MlflowClient(tracking_uri=uri).get_experiment("0").name == "Default"


@pytest.mark.slow
def test_init_store_from_four_processes_at_once(tmp_path):
    """All four wait for the lock (held here), then initialise the fresh database one after another."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    lock = mr.init_lock_path(uri)
    ctx = multiprocessing.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=workers.init_store_when_told, args=(uri, ready, go, results)) for _ in range(4)]
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        for proc in procs:
            proc.start()
        try:
            for _ in procs:
                ready.get(timeout=90)
            go.set()
            time.sleep(1.5)
            assert results.empty(), "init_store returned while another process held the lock"
            released = time.time()
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
        outcomes = [results.get(timeout=90) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert [kind for kind, _ in outcomes] == ["ok"] * 4, outcomes
    assert all(when >= released for _, when in outcomes)
    run_id = mr.create_run(uri, experiment="e", run_name="after-race", params={}, tags={})
    assert mr.find_run(uri, run_id)["status"] == "SCHEDULED"


def test_flatten_params_dotted_json_and_truncated():
    flat = mr.flatten_params({"train": {"lr": 0.001, "sched": {"warmup": 10}}, "tasks": ["a", "b"],
                              "empty": {}, "none": None, "bad key!": 1, "long": "x" * 10_000})
    assert flat["train.lr"] == "0.001"
    assert flat["train.sched.warmup"] == "10"
    assert flat["tasks"] == '["a","b"]'
    assert flat["empty"] == "{}"
    assert flat["none"] == "None"
    assert flat["bad key_"] == "1"
    assert len(flat["long"]) == mr.MAX_PARAM_VALUE_LENGTH
    assert flat["long"].endswith(f"...[truncated {10_000 - flat['long'].count('x')} chars]")
    for length in (6001, 6020, 9999, 10_005, 123_456):  # markers of different widths: never over the limit
        cut = mr.truncate("y" * length, 6000)
        assert len(cut) == 6000 and cut.endswith(f"[truncated {length - cut.count('y')} chars]")
    assert mr.truncate("short", 6000) == "short"


def test_metric_key_sanitised():
    assert mr.metric_key("train/loss") == "train/loss"
    assert mr.metric_key("eval/success@10%") == "eval/success_10_"
    assert mr.metric_key("/a//b/./c/") == "a/b/c"
    assert len(mr.metric_key("k" * 400)) == mr.MAX_KEY_LENGTH


def test_create_run_params_tags_status_and_artifact_location(tmp_path, sqlite_uri):
    params = {"model": {"name": "pi05", "layers": 4}, "notes": "n" * 7000}
    run_id = mr.create_run(sqlite_uri, experiment="pick", run_name="pi05-1", params=params,
                           tags={"embodyhpc.run_dir": "/runs/pick/pi05-1"})
    found = mr.find_run(sqlite_uri, run_id)
    assert found["name"] == "pi05-1"
    assert found["experiment"] == "pick"
    assert found["status"] == "SCHEDULED"
    assert found["params"]["model.name"] == "pi05"
    assert found["params"]["model.layers"] == "4"
    assert len(found["params"]["notes"]) == mr.MAX_PARAM_VALUE_LENGTH
    assert found["tags"]["embodyhpc.run_dir"] == "/runs/pick/pi05-1"
    assert found["artifact_uri"].startswith(str(tmp_path / "runs" / "mlartifacts"))
    again = mr.create_run(sqlite_uri, experiment="pick", run_name="pi05-2", params={}, tags={})
    assert mr.find_run(sqlite_uri, again)["experiment_id"] == found["experiment_id"]


def test_create_run_many_params_in_batches(sqlite_uri):
    params = {f"p{i}": i for i in range(250)}  # MLflow takes at most 100 per call
    run_id = mr.create_run(sqlite_uri, experiment="e", run_name="r", params=params, tags={})
    assert len(mr.find_run(sqlite_uri, run_id)["params"]) == 250


@pytest.mark.slow
def test_child_run_from_another_process(tmp_path, sqlite_uri):
    parent = mr.create_run(sqlite_uri, experiment="pick", run_name="train", params={}, tags={})
    plot, videos = report_files(tmp_path)
    out = child_run_in_subprocess(sqlite_uri, parent, 1200, plot, videos)
    check_child_run(sqlite_uri, parent, out["run_id"], 1200)
    assert mr.find_run(sqlite_uri, out["run_id"])["parent_run_id"] == parent


def test_child_run_refuses_missing_artifact_before_creating(tmp_path, sqlite_uri):
    parent = mr.create_run(sqlite_uri, experiment="e", run_name="train", params={}, tags={})
    with pytest.raises(mr.TrackingError, match="do not exist"):
        mr.log_child_run(sqlite_uri, parent, run_name="eval", metrics={"a": 1.0},
                         artifacts=[(tmp_path / "missing.png", "plots")])
    from mlflow import MlflowClient

    runs = MlflowClient(tracking_uri=sqlite_uri).search_runs([mr.find_run(sqlite_uri, parent)["experiment_id"]])
    assert [run.info.run_id for run in runs] == [parent]


def test_child_run_skips_nonfinite_and_counts_them(sqlite_uri):
    parent = mr.create_run(sqlite_uri, experiment="e", run_name="train", params={}, tags={})
    child = mr.log_child_run(sqlite_uri, parent, run_name="eval", step=7,
                             metrics={"ok": 0.5, "nan": float("nan"), "inf": float("inf")})
    assert mr.latest_metrics(sqlite_uri, child) == {"ok": 0.5, mr.NONFINITE_METRIC: 2.0}


def test_child_run_of_unknown_parent_is_a_tracking_error(sqlite_uri):
    with pytest.raises(mr.TrackingError, match="parent run"):
        mr.log_child_run(sqlite_uri, "0" * 32, run_name="eval", metrics={"a": 1.0})


def test_find_run_unknown_and_missing_store(tmp_path, sqlite_uri):
    assert mr.find_run(sqlite_uri, "0" * 32) is None
    missing = f"sqlite:///{tmp_path / 'nowhere' / 'mlflow.db'}"
    assert mr.find_run(missing, "0" * 32) is None
    assert not (tmp_path / "nowhere").exists()  # reading never creates a store
    with pytest.raises(mr.TrackingError):
        mr.latest_metrics(sqlite_uri, "0" * 32)


def test_set_terminated_only_if_active(sqlite_uri):
    run_id = mr.create_run(sqlite_uri, experiment="e", run_name="r", params={}, tags={})
    assert mr.set_terminated(sqlite_uri, run_id, "FINISHED") is True
    assert mr.set_terminated(sqlite_uri, run_id, "FAILED", only_if_active=True) is False
    assert mr.find_run(sqlite_uri, run_id)["status"] == "FINISHED"
    other = mr.create_run(sqlite_uri, experiment="e", run_name="r2", params={}, tags={})
    assert mr.set_terminated(sqlite_uri, other, "FAILED", only_if_active=True) is True
    found = mr.find_run(sqlite_uri, other)
    assert found["status"] == "FAILED" and found["end_time"] is not None
    with pytest.raises(ValueError):
        mr.set_terminated(sqlite_uri, other, "DONE")


def test_log_artifacts_to_existing_run(tmp_path, sqlite_uri):
    run_id = mr.create_run(sqlite_uri, experiment="e", run_name="r", params={}, tags={})
    plot, videos = report_files(tmp_path)
    mr.log_artifacts(sqlite_uri, run_id, [plot, (videos, "media")])
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=sqlite_uri)
    assert {f.path for f in client.list_artifacts(run_id)} == {"success.png", "media"}
    assert len(client.list_artifacts(run_id, "media")) == 3


def test_ui_hint(tmp_path):
    uri = f"sqlite:///{tmp_path / 'my runs' / 'mlflow.db'}"
    hint = mr.ui_hint(uri)
    assert hint.startswith("mlflow ui --backend-store-uri ")
    assert f"'{uri}'" in hint  # quoted: the path has a space
    assert hint.endswith("# then open http://127.0.0.1:5000/#/experiments?workflowType=machine_learning")
    assert mr.ui_hint("https://mlflow.example.org") == \
        "https://mlflow.example.org/#/experiments?workflowType=machine_learning"


def test_ui_hint_opens_the_runs_page_of_a_run(sqlite_uri):
    run_id = mr.create_run(sqlite_uri, experiment="hints", run_name="r")
    experiment_id = mr.find_run(sqlite_uri, run_id)["experiment_id"]
    assert mr.ui_hint(sqlite_uri, run_id).endswith(
        f"# then open http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning")
    assert mr.ui_hint(sqlite_uri, "0" * 32).endswith("/#/experiments?workflowType=machine_learning")  # no such run
    assert mr.ui_link("http://h:1/", "3&x") == "http://h:1/#/experiments/3%26x?workflowType=machine_learning"

