"""The training run's export as an MLflow logged model: logged on the run with its tensor signature (read back
through MlflowClient from the real sqlite store), loaded back with mlflow.pyfunc.load_model, and predicting real
action chunks on the CPU from a tiny pi0.5; a failure to log is a warning, never an exception."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from embodyhpc.launch.policy_model import ACTIONS_OUTPUT, MODEL_NAME, log_training_model
from embodyhpc.models import build_model
from embodyhpc.rundir import POLICY_IO_FILE
from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.validation import load_recipe
from tests.exports import make_export

RECIPE = "recipes/demo_metaworld_cpu.yaml"
STATE = "observation.environment_state"


@pytest.fixture
def export(tmp_path):
    """A whole export of the demo recipe's tiny pi0.5 with the policy_io.json training writes beside it."""
    loaded = load_recipe(RECIPE)
    torch.manual_seed(0)
    model = build_model(loaded.config.model, loaded.config.precision)
    out = make_export(tmp_path / "run" / "export", model, config_yaml=loaded.to_yaml())
    (out / POLICY_IO_FILE).write_text(json.dumps({"cameras": ["corner"], "image_size": 32, "state_key": STATE,
                                                  "action_dim": 4, "fps": 10}))
    (out / "normalization.json").write_text(json.dumps({"key": STATE, "mode": "mean_std", "offset": [0.0] * 39,
                                                        "scale": [1.0] * 39}))  # the recipe normalises its state
    return out, loaded.config


@pytest.mark.slow
def test_the_training_run_gets_its_export_as_a_logged_model_that_predicts(sqlite_uri, export, capsys, monkeypatch):
    import mlflow.pyfunc

    out, config = export
    run_id = mr.create_run(sqlite_uri, experiment="demo", run_name="train", status="RUNNING")
    mr.set_terminated(sqlite_uri, run_id, "FINISHED")
    model_id = log_training_model(sqlite_uri, run_id, out)
    assert model_id, capsys.readouterr().err

    client = mr.client(sqlite_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"  # logging the model did not reopen or end the run
    assert [o.model_id for o in run.outputs.model_outputs] == [model_id]
    logged = client.get_logged_model(model_id)
    assert logged.name == MODEL_NAME and logged.source_run_id == run_id
    from mlflow.models import get_model_info

    monkeypatch.setenv("MLFLOW_TRACKING_URI", sqlite_uri)  # how a user points models:/ at the store
    signature = get_model_info(f"models:/{model_id}").signature
    horizon = config.model.action_horizon
    inputs = {spec.name: (spec.type, spec.shape) for spec in signature.inputs.inputs}
    assert inputs == {"observation.images.corner": (np.dtype(np.uint8), (-1, 32, 32, 3)),
                      STATE: (np.dtype(np.float32), (-1, -1)), "task": (np.dtype(object), (-1,))}
    [output] = signature.outputs.inputs
    assert (output.name, output.type, output.shape) == (ACTIONS_OUTPUT, np.dtype(np.float32), (-1, horizon, 4))

    loaded = mlflow.pyfunc.load_model(f"models:/{model_id}")
    rng = np.random.default_rng(0)
    observation = {"observation.images.corner": rng.integers(0, 255, (1, 32, 32, 3), dtype=np.uint8),
                   STATE: rng.random((1, 39), dtype=np.float32), "task": np.array(["reach"], dtype=object)}
    actions = loaded.predict(observation)
    assert actions.shape == (1, horizon, 4) and actions.dtype == np.float32 and np.isfinite(actions).all()
    np.testing.assert_array_equal(loaded.predict(observation), actions)  # seeded per row: reproducible
    two = {key: np.concatenate([value, value]) for key, value in observation.items()}
    assert loaded.predict(two).shape == (2, horizon, 4)  # one chunk per row, in one batch
    with pytest.raises(Exception, match="uint8"):  # the signature is enforced: images must be bytes
        loaded.predict({**observation, "observation.images.corner": observation["observation.images.corner"] * 0.5})
    with pytest.raises(Exception, match="observation.images.corner"):  # a camera missing
        loaded.predict({key: value for key, value in observation.items() if key != "observation.images.corner"})
    with pytest.raises(Exception, match=r"same number of rows.*\[1, 2\]"):  # rows that do not line up
        loaded.predict({**observation, "task": np.array(["reach", "push"], dtype=object)})


def test_a_model_that_cannot_be_logged_is_a_warning(sqlite_uri, export, capsys, tmp_path):
    out, _ = export
    run_id = mr.create_run(sqlite_uri, experiment="demo", run_name="train", status="RUNNING")
    assert log_training_model(sqlite_uri, "0" * 32, out) is None  # no such run
    assert "was not logged as an MLflow model" in capsys.readouterr().err
    (out / "config.yaml").write_text("model: [unclosed\n")  # a damaged export
    assert log_training_model(sqlite_uri, run_id, out) is None
    assert "was not logged" in capsys.readouterr().err
    assert not mr.client(sqlite_uri).get_run(run_id).outputs.model_outputs


def test_an_unreachable_server_is_a_quick_warning(export, capsys, unreachable):
    out, _ = export
    assert log_training_model(unreachable.uri, "0" * 32, out) is None
    # bounded retries, not MLflow's default 8 tries and minutes of back-off
    assert 0 < unreachable.connects <= 8 and unreachable.backoff_s < 10, vars(unreachable)
    assert "was not logged as an MLflow model" in capsys.readouterr().err


@pytest.mark.slow  # the server takes 9-30 s to answer /health on a shared machine
def test_through_a_real_server_the_model_and_its_signature_are_on_the_run(mlflow_server, export, monkeypatch):
    import urllib.request

    import mlflow.pyfunc

    out, config = export
    uri = mlflow_server
    run_id = mr.create_run(uri, experiment="logged-model", run_name="train", status="RUNNING")
    model_id = log_training_model(uri, run_id, out)
    assert model_id
    with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/logged-models/{model_id}", timeout=30) as response:
        model = json.loads(response.read())["model"]
    assert model["info"]["name"] == MODEL_NAME and model["info"]["source_run_id"] == run_id
    with urllib.request.urlopen(f"{uri}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=30) as response:
        outputs = json.loads(response.read())["run"]["outputs"]["model_outputs"]
    assert [o["model_id"] for o in outputs] == [model_id]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    loaded = mlflow.pyfunc.load_model(f"models:/{model_id}")  # artifacts through the server's proxy
    [output] = loaded.metadata.get_output_schema().inputs
    assert output.shape == (-1, config.model.action_horizon, 4)
    rng = np.random.default_rng(1)
    actions = loaded.predict({"observation.images.corner": rng.integers(0, 255, (1, 32, 32, 3), dtype=np.uint8),
                              STATE: rng.random((1, 39), dtype=np.float32), "task": np.array(["push"], dtype=object)})
    assert actions.shape == (1, config.model.action_horizon, 4) and np.isfinite(actions).all()
