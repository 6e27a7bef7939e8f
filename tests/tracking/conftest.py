"""Tracking tests: MLflow without telemetry, and a fresh sqlite store per test (copied from one made per session)."""

from __future__ import annotations

import os
import shutil

import pytest

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"  # before any mlflow import, here and in spawned children


@pytest.fixture(scope="session")
def _store_template(tmp_path_factory):
    """A database initialised once by init_store (creating the schema costs seconds; copying it, milliseconds)."""
    from embodyhpc.tracking.mlflow_run import init_store

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    init_store(f"sqlite:///{db}")
    return db


@pytest.fixture
def sqlite_uri(tmp_path, _store_template) -> str:
    """`sqlite:///<tmp>/runs/mlflow.db`, initialised; its artifacts go to <tmp>/runs/mlartifacts."""
    from embodyhpc.tracking.mlflow_run import init_store

    db = tmp_path / "runs" / "mlflow.db"
    db.parent.mkdir()
    shutil.copyfile(_store_template, db)
    uri = f"sqlite:///{db}"
    init_store(uri)  # the up-to-date path: takes the lock, finds nothing to do
    return uri
