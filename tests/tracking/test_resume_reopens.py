"""`embodyhpc resume` of a run whose last attempt logged past its newest checkpoint: what the resume does before its
chain starts (resume.begin_attempt, the real function; only the chain is not run) leaves one MLflow value per step
in the run's sqlite store: the steps after the checkpoint are gone, the steps up to it and telemetry stay."""

from __future__ import annotations

import json
import sys
import time

import pytest

from embodyhpc.runinfo import RunInfo
from embodyhpc.tracking import mlflow_run as mr
from tests.test_resume import fake_run


def _log(uri: str, run_id: str, key: str, steps: range) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    mr.client(uri).log_batch(run_id, metrics=[Metric(key, float(step), now + step, step) for step in steps])


@pytest.fixture(scope="session")
def torch_module():
    """torch (the stand-in's checkpoint is a torch file): imported once, charged to the suite as the other shared
    imports are."""
    import torch

    return torch


def test_a_resume_drops_the_values_logged_past_the_checkpoint_it_starts_from(sqlite_uri, torch_module):
    torch = torch_module
    from embodyhpc.resume import begin_attempt, plan_resume

    runs_root = mr.sqlite_path(sqlite_uri).parent
    # a run of 40 steps killed at step 40 after its checkpoint of step 30 (the synthetic stand-in: its checkpoint is
    # one state file), resumed to train to 60
    run = fake_run(runs_root, steps=40, checkpoints=(), train_state="FAILED", overrides=("data.format=synthetic",))
    torch.save({"step": 30, "weights": torch.zeros(4)}, run / "checkpoints" / "spine-state.pt")
    run_id = mr.create_run(sqlite_uri, experiment="demo", run_name="train", status="RUNNING")
    _log(sqlite_uri, run_id, "train/loss", range(1, 41))  # steps 31-40: no checkpoint holds them
    _log(sqlite_uri, run_id, "system/node_0/cpu_utilization_percentage", range(0, 50))
    mr.set_terminated(sqlite_uri, run_id, "KILLED")
    info = RunInfo.load(run)
    info.mlflow_run_id = run_id
    info.save()

    said: list[str] = []
    plan = plan_resume(run, ["train.steps=60"], check_jobs=False, progress=said.append)
    loaded, info = begin_attempt(plan, sys.executable, local=True, progress=said.append)
    assert (info.attempt, info.resumed_from_step, loaded.config.train.steps) == (2, 30, 60)
    client = mr.client(sqlite_uri)
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == list(range(1, 31))
    assert len(client.get_metric_history(run_id, "system/node_0/cpu_utilization_percentage")) == 50
    found = client.get_run(run_id)
    assert found.info.status == "SCHEDULED" and found.data.metrics["train/loss"] == 30.0
    assert any("10 value(s) after step 30 that no checkpoint holds dropped" in line for line in said), said
    assert json.loads((run / "run.json").read_text())["resumed_from_step"] == 30
