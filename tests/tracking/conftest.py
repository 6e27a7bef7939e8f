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


@pytest.fixture
def unreachable(monkeypatch):
    """A tracking URI nothing listens on, and what calls to it cost, counted instead of timed: every connection
    tried and every back-off sleep asked for (not slept). MLflow alone, on one request: 8 connections and ~250 s of
    back-off (7 retries, factor 2); the project's bounds keep both small whatever the machine's speed."""
    import socket
    import time
    from types import SimpleNamespace

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens there once the socket is closed
    cost = SimpleNamespace(uri=f"http://127.0.0.1:{port}", connects=0, backoff_s=0.0)
    real_connect = socket.socket.connect

    def connect(self, address):
        if isinstance(address, tuple) and address[1:2] == (port,):
            cost.connects += 1
        return real_connect(self, address)

    def sleep(seconds: float) -> None:
        cost.backoff_s += seconds

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(time, "sleep", sleep)
    return cost
