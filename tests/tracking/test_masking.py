"""Hardening round 3, class 4: what MLflow keeps and what tracking prints hold no credential, and nothing else is
masked: the recipe MLflow keeps loads and runs again as it is."""

from __future__ import annotations

import io

import yaml

from embodyhpc.tracking import mlflow_run as mr

PASSWORD = "pw_sekrit_0123456789"


def test_the_logged_recipe_is_the_run_config_and_its_params_read_as_set(tmp_path, sqlite_uri):
    """submit logs params=_params(loaded) and recipe/resolved.yaml = yaml(redact(params)): keys ending in key, token or
    len are settings, shown as they are; the artifact, loaded again, is the same config."""
    from embodyhpc.tracking.mlflow_values import redact
    from embodyhpc.validation import load_config_file, load_recipe

    loaded = load_recipe("smoke_cpu", ["model.state_key=observation.environment_state", "model.max_token_len=96",
                                       "network.extra_env={NCCL_IB_PKEY: '0x8001'}", "checkpoint.keep_latest_k=3"])
    params = yaml.safe_load(loaded.to_yaml())
    run_id = mr.create_run(sqlite_uri, experiment="masking", run_name="r", params=params,
                           texts={"recipe/resolved.yaml": yaml.safe_dump(redact(params), sort_keys=False)})
    logged = mr.find_run(sqlite_uri, run_id)["params"]
    assert logged["model.state_key"] == "observation.environment_state"
    assert logged["model.max_token_len"] == "96" and logged["network.extra_env.NCCL_IB_PKEY"] == "0x8001"
    path = mr.client(sqlite_uri).download_artifacts(run_id, "recipe/resolved.yaml", str(tmp_path))
    assert load_config_file(path) == loaded.config


def test_a_store_error_never_shows_the_password(unreachable):
    """MLflow's REST errors quote the request URL; a URI with a login (an old run's resolved.yaml) stays masked."""
    uri = unreachable.uri.replace("http://", f"http://alice:{PASSWORD}@")
    try:
        mr.create_run(uri, experiment="masking", run_name="r")
    except mr.TrackingError as exc:
        assert PASSWORD not in str(exc) and "alice:***@" in str(exc), str(exc)
    else:
        raise AssertionError("nothing listens there: create_run must fail")


def test_the_training_sink_never_prints_the_password(unreachable):
    from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink

    err = io.StringIO()
    uri = unreachable.uri.replace("http://", f"http://alice:{PASSWORD}@")
    sink = MlflowMetricsSink(uri, "0" * 32, flush_every=1, retry_interval_s=3600, stream=err)
    sink.write(1, {"loss": 1.0})
    sink.close()
    assert "unreachable" in err.getvalue() and PASSWORD not in err.getvalue(), err.getvalue()


def test_dashboard_hints_hold_no_password():
    assert mr.ui_hint(f"https://alice:{PASSWORD}@mlflow.example:5000") == \
        "https://mlflow.example:5000/#/experiments?workflowType=machine_learning"
    hint = mr.ui_hint(f"postgresql://mlflow:{PASSWORD}@db.example/mlflow")
    assert PASSWORD not in hint and "postgresql://mlflow:***@db.example/mlflow" in hint


def test_tags_and_exception_lines_are_masked():
    from embodyhpc.tracking.mlflow_values import one_line, tags_of

    tags = tags_of({"mlflow.source.name": f"embodyhpc submit r.yaml tracking.mlflow_uri=http://a:{PASSWORD}@h"})
    assert PASSWORD not in str(tags)
    assert PASSWORD not in one_line(RuntimeError(f"API request to https://a:{PASSWORD}@h/api/2.0 failed"))
