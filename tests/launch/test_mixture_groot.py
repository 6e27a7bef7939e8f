"""GR00T's demo recipe trained on a two-embodiment mixture (data.datasets) through the CLI, end to end:
`embodyhpc submit recipes/demo_groot_metaworld_cpu.yaml --local` on 2 processes (FSDP2 over gloo), with two small
LeRobot datasets of different robots (state 4 / 6 dims, action 4 / 2 dims) tagged gr1 (24) and oxe_droid (17).

What it holds: both embodiments' rows of the per-embodiment layers were trained (their weights moved from the
initial ones, which the test rebuilds from train.seed) while an embodiment no dataset names (31, the recipe's own)
stayed exactly at its initial weights (weight decay off: Adam gives a row with zero gradient a zero update); the loss
is finite and falls; every dataset's statistics are saved beside the checkpoints; the MLflow run lists each dataset
as an input with its weight.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.data.test_mixture import write_robot
from tests.helpers import run_dir_from
from tests.launch.demo import GROOT_DEMO, embodyhpc

pytestmark = [pytest.mark.slow]

STEPS = 30
IDS = {"gr1": 24, "oxe_droid": 17}


def test_groot_demo_trains_on_a_two_embodiment_mixture(tmp_path):
    a = write_robot(tmp_path / "gr1", 4, 4, 1.0, 0.0, seed=0, episodes=4, frames=20)
    b = write_robot(tmp_path / "droid", 6, 2, 50.0, 300.0, seed=1, episodes=4, frames=20)
    result = embodyhpc(
        "submit", GROOT_DEMO, "--local", "--json", f"job.runs_root={tmp_path / 'runs'}", "data.root=null",
        f"data.datasets=[{{root: {a}, weight: 3, embodiment: gr1}}, {{root: {b}, weight: 1, embodiment: oxe_droid}}]",
        "data.delta_timestamps={action: [0.0, 0.1, 0.2, 0.3]}", "data.num_workers=0", "model.action_horizon=4",
        "model.state_key=observation.state", "eval.enabled=false", f"train.steps={STEPS}", "train.warmup_steps=2",
        "train.log_every=5", "train.weight_decay=0", f"checkpoint.every_steps={STEPS}", "eval.execute_steps=4",
        timeout_s=600)
    run_dir = run_dir_from(result.stdout)
    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics]
    assert len(losses) == STEPS // 5 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0], losses

    saved = json.loads((run_dir / "checkpoints" / "normalization_datasets.json").read_text())
    assert [d["root"] for d in saved["datasets"]] == [str(a), str(b)] and saved["eval_index"] == 0

    # MLflow: one training input per dataset, with its weight and its share of the samples
    from embodyhpc.runinfo import RunInfo
    from embodyhpc.tracking.mlflow_run import client, tracking_uri
    from embodyhpc.validation import load_resolved

    config = load_resolved(run_dir)
    run = client(tracking_uri(config.tracking, config.job.runs_root)).get_run(RunInfo.load(run_dir).mlflow_run_id)
    inputs = {json.loads(i.dataset.source)["uri"]: json.loads(i.dataset.profile) for i in run.inputs.dataset_inputs}
    assert {root: (p["weight"], p["share"], p["embodiment"]) for root, p in inputs.items()} == {
        str(a): (3, 0.75, "gr1"), str(b): (1, 0.25, "oxe_droid")}

    from embodyhpc.models import build_model
    from embodyhpc.parallel.parallelize import materialize

    with torch.device("meta"):
        initial = build_model(config.model, config.precision)
    materialize(initial, "cpu", seed=config.train.seed)
    trained = _final_weights(run_dir, config)
    name = "action_head.state_encoder.layer1.W"
    assert name in trained, sorted(k for k in trained if "state_encoder" in k)
    start = dict(initial.named_parameters())[name].detach()
    moved = {c: float((trained[name][c] - start[c]).abs().max()) for c in (*IDS.values(), 31)}
    assert moved[IDS["gr1"]] > 0 and moved[IDS["oxe_droid"]] > 0, moved
    assert moved[31] == 0, moved  # no sample of embodiment 31: its row never got a gradient


def _final_weights(run_dir, config) -> dict[str, torch.Tensor]:
    """The trained weights: the export's, else the last checkpoint's (full tensors, on one process)."""
    from safetensors.torch import load_file

    export = run_dir / "export" / "model.safetensors"
    if export.is_file():
        return load_file(str(export))
    import torch.distributed.checkpoint as dcp

    from embodyhpc.models import build_model

    step = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    model = build_model(config.model, config.precision)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(step))
    return dict(state["model"])
