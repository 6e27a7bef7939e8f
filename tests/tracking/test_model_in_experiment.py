"""The trained policy's logged model belongs to its training run's experiment (not MLflow's Default), is that
run's output, and carries the export's evaluation metrics (with the evaluation as their dataset), read back from a
real sqlite store. A tiny python model stands in for the policy (test_logged_model loads the real one, slow)."""

from __future__ import annotations

import mlflow.pyfunc

from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.tracking.evaluation import eval_params, log_evaluation
from embodyhpc.tracking.logged_model import EXPORT_TAG, log_pyfunc_model
from tests.tracking.test_eval_logging import EVAL, TASKS, results


class Echo(mlflow.pyfunc.PythonModel):
    def predict(self, context, model_input, params=None):
        return model_input


def log_policy(uri: str, run_id: str, export: str, tmp_path) -> str:
    weights = tmp_path / "weights.txt"
    weights.write_text("w")
    return log_pyfunc_model(uri, run_id, name="policy", python_model=Echo(), artifacts={"export": str(weights)},
                            inputs=[("x", "float32", (-1, 2))], outputs=[("y", "float32", (-1, 2))],
                            requirements=["embodyhpc"], tags={EXPORT_TAG: export})


def test_the_model_is_in_the_runs_experiment_with_the_evaluation_linked(sqlite_uri, tmp_path):
    run_id = mr.create_run(sqlite_uri, experiment="demo", run_name="train", status="RUNNING")
    mr.log_step_metrics(mr.client(sqlite_uri), run_id, {"system/cpu": 12.0, "train/loss": 0.5}, 0)
    model_id = log_policy(sqlite_uri, run_id, "/runs/demo/export", tmp_path)

    client = mr.client(sqlite_uri)
    run = client.get_run(run_id)
    experiment_id = run.info.experiment_id
    assert experiment_id != "0"  # the test would mean nothing in the Default experiment
    model = client.get_logged_model(model_id)
    assert (model.experiment_id, model.source_run_id, model.name) == (experiment_id, run_id, "policy")
    assert [m.model_id for m in client.search_logged_models(experiment_ids=[experiment_id])] == [model_id]
    assert not list(client.search_logged_models(experiment_ids=["0"]))
    assert [o.model_id for o in run.outputs.model_outputs] == [model_id]
    assert run.info.status == "RUNNING"  # logging the model neither ended nor restarted the run
    assert not model.metrics  # no system metric or step-0 loss passed off as the model's result

    # the run's own evaluation of its export: the trained policy's numbers linked to the model, with the dataset
    params = eval_params(EVAL, step=600, weights="/runs/demo/export", tasks=TASKS)
    child = log_evaluation(sqlite_uri, run_id, step=600, results=results((4, 5)), params=params, outcome="complete",
                           why="all shards reported", summary=None, artifacts=[], start_ms=None, end_ms=None)
    linked = {m.key: m for m in client.get_logged_model(model_id).metrics}
    assert linked["eval/trained/success_rate"].value == 0.9  # 9 of 10 episodes, chosen above
    assert linked["eval/trained/reach-v3/success_rate"].value == 0.8
    assert {m.run_id for m in linked.values()} == {child} and {m.step for m in linked.values()} == {600}
    assert {m.dataset_name for m in linked.values()} == {"metaworld eval"}
    assert not [key for key in linked if "/random" in key or "/expert" in key]  # references are not this model
    history = client.get_metric_history(child, "eval/trained/success_rate")
    assert [(m.step, m.value) for m in history] == [(600, 0.9)]  # once on the run (the link is the model's)

    # an evaluation of other weights (a checkpoint) is not this model's
    other = eval_params(EVAL, step=400, weights="/runs/demo/checkpoints/step-400", tasks=TASKS)
    log_evaluation(sqlite_uri, run_id, step=400, results=results((1, 1)), params=other, outcome="complete",
                   why="all shards reported", summary=None, artifacts=[], start_ms=None, end_ms=None)
    assert {m.step for m in client.get_logged_model(model_id).metrics} == {600}


def test_a_second_run_in_another_experiment_keeps_its_own_model(sqlite_uri, tmp_path):
    """Two experiments, one model each: each is found in its own run's experiment only."""
    first = mr.create_run(sqlite_uri, experiment="a", run_name="train", status="RUNNING")
    second = mr.create_run(sqlite_uri, experiment="b", run_name="train", status="RUNNING")
    ids = {run: log_policy(sqlite_uri, run, f"/runs/{run}/export", tmp_path) for run in (first, second)}
    client = mr.client(sqlite_uri)
    for run, model_id in ids.items():
        experiment_id = client.get_run(run).info.experiment_id
        assert [m.model_id for m in client.search_logged_models(experiment_ids=[experiment_id])] == [model_id]


def test_logging_the_model_prints_nothing_into_the_jobs_log(sqlite_uri, tmp_path, capfd):
    """`embodyhpc logs` shows the training job's stderr: MLflow's advice (input example, type hints) and its
    artifact progress bars stay out of it; the logged model is still there."""
    import warnings

    run_id = mr.create_run(sqlite_uri, experiment="demo", run_name="train", status="RUNNING")
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # what a job's fresh interpreter does on first sight of each warning
        model_id = log_policy(sqlite_uri, run_id, "/runs/demo/export", tmp_path)
    out, err = capfd.readouterr()
    assert model_id and mr.client(sqlite_uri).get_logged_model(model_id).source_run_id == run_id
    assert "Warning" not in err and "Downloading" not in err and "Uploading" not in err and "%|" not in err, err
