"""Evaluations of checkpoints while training runs: which steps, the evaluation run each gets (recipe, pin, parent,
chain), the export job, and sbatch's environment when a job submits them."""

from __future__ import annotations

import json

import pytest
import torch

from embodyhpc.checkpoint import layout
from embodyhpc.config.load import load_recipe, load_resolved
from embodyhpc.launch import checkpoint_eval
from embodyhpc.launch.export import export_task
from embodyhpc.orchestrate.plan import chain_kinds
from embodyhpc.rundir import RunInfo, requested_evals
from embodyhpc.slurm.executor import without_job_environment

RECIPE = "recipes/demo_metaworld_cpu.yaml"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _config(*overrides):
    return load_recipe(RECIPE, ["checkpoint.every_steps=200", "train.steps=1000", *overrides]).config


def test_every_kth_periodic_checkpoint_short_of_the_last_step():
    config = _config("eval.every_k_checkpoints=2")
    assert [s for s in range(0, 1201, 100) if checkpoint_eval.evaluates_step(config, s)] == [400, 800]
    assert not any(checkpoint_eval.evaluates_step(_config("eval.every_k_checkpoints=0"), s) for s in range(1, 1001))
    config = _config("eval.every_k_checkpoints=1", "eval.enabled=false")
    assert not any(checkpoint_eval.evaluates_step(config, s) for s in range(1, 1001))
    assert checkpoint_eval.hook("/run", _config("eval.every_k_checkpoints=0")) is None  # the loop gets no hook


def test_a_requested_evaluation_is_a_run_of_its_own_that_pins_the_checkpoint(training_run):
    run, _ = training_run
    checkpoint = run / "checkpoints" / "step-40"
    messages = []
    target = checkpoint_eval.request(run, 40, checkpoint, progress=messages.append)
    assert target == run / "evals" / "step-40" and "asked for" in messages[0]
    assert requested_evals(run) == [target]
    info = RunInfo.load(target)
    assert (info.backend, info.parent_run, info.mlflow_run_id) == ("local", str(run), "mlflow-parent")
    assert info.python == "/venv/bin/python" and info.jobs == {}  # the local `submit` process runs it
    config = load_resolved(target)
    assert config.eval.weights == str(checkpoint)
    assert config.model == load_resolved(run).model and config.eval.tasks == load_resolved(run).eval.tasks
    # the reference rows are the run's own chain's: not evaluated again at every checkpoint
    assert load_resolved(run).eval.reference_policies and config.eval.reference_policies == []
    assert layout.pinned_by(checkpoint) == [str(target)]
    assert chain_kinds(load_recipe(str(target / "resolved.yaml")), eval_only=True) == ["export", "eval", "report"]
    assert checkpoint_eval.request(run, 40, checkpoint, progress=messages.append) is None  # once per step


def test_export_job_writes_the_step_export_with_side_files_and_unpins(training_run):
    run, model = training_run
    checkpoint = run / "checkpoints" / "step-40"
    target = checkpoint_eval.request(run, 40, checkpoint, progress=lambda m: None)
    result = export_task(str(target))
    out = run / "exports" / "step-40"
    assert result["export"] == str(out) and result["written"]
    from embodyhpc.checkpoint import load_exported

    weights, summary = load_exported(out)
    assert summary["step"] == 40
    for key, tensor in model.state_dict().items():
        assert torch.equal(weights[key], tensor), key
    assert (out / "config.yaml").read_text() == (run / "resolved.yaml").read_text()
    assert json.loads((out / "policy_io.json").read_text()) == {"file": "policy_io.json"}
    assert layout.pinned_by(checkpoint) == []
    assert export_task(str(target))["written"] is False  # already whole: not written again
    from embodyhpc.launch.eval import weights_dir

    assert weights_dir(load_resolved(target), target) == out  # where the shards look, whatever became of step-40


def test_sbatch_from_inside_a_job_leaves_the_job_environment_behind():
    inside = {"SLURM_JOB_ID": "41", "SLURM_NTASKS": "2", "SLURMD_NODENAME": "n1", "SRUN_DEBUG": "3",
              "SUBMITIT_EXECUTOR": "slurm", "RANK": "0", "MASTER_ADDR": "n1", "SBATCH_ACCOUNT": "robotics",
              "PATH": "/usr/bin", "NCCL_IB_HCA": "mlx5_0", "SLURM_CONF": "/etc/slurm-site/slurm.conf"}
    command = without_job_environment(inside)
    assert command[0] == "env"
    assert sorted(command[2::2]) == ["MASTER_ADDR", "RANK", "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_NTASKS",
                                     "SRUN_DEBUG", "SUBMITIT_EXECUTOR"]
    assert set(command[1::2]) == {"-u"}  # SLURM_CONF stays: without it sbatch cannot find the controller
    # from a login shell, SBATCH_* and everything else are the user's own settings: untouched
    assert without_job_environment({"SBATCH_ACCOUNT": "robotics", "SLURM_CONF": "/etc/slurm.conf"}) == []


def _children(uri: str, parent_run_id: str) -> dict[str, dict]:
    from embodyhpc.tracking.mlflow_run import client, find_run

    runs = client(uri).search_runs(experiment_ids=[find_run(uri, parent_run_id)["experiment_id"]],
                                   filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'")
    return {run.info.run_name: find_run(uri, run.info.run_id) for run in runs}


@pytest.mark.slow
def test_local_training_evaluates_every_kth_checkpoint_beside_training(cli, runs_root, reach_demos):
    from tests.helpers import run_dir_from

    result = cli("submit", RECIPE, "--local", "--json", f"job.runs_root={runs_root}", f"data.root={reach_demos}",
                 "train.steps=80", "train.log_every=10", "train.warmup_steps=5", "checkpoint.every_steps=10",
                 "checkpoint.keep_latest_k=2", "eval.every_k_checkpoints=2", "eval.tasks=[reach-v3]",
                 "eval.episodes_per_task=2", "eval.shards=2", "eval.max_steps=30", "eval.videos_per_task=0",
                 "eval.reference_policies=[random]")
    assert result.code == 0, result.err
    run = run_dir_from(result.out)
    final = json.loads((run / "eval" / "report.json").read_text())
    assert final["checkpoint_step"] == 80 and final["eval"]["episodes_recorded"] == {"trained": 2, "random": 2}
    evals = requested_evals(run)
    assert [p.name for p in evals] == ["step-20", "step-40", "step-60"]
    for path in evals:
        step = int(path.name.split("-")[1])
        info = RunInfo.load(path)
        assert {k: j.state for k, j in info.jobs.items()} == {"export": "COMPLETED", "eval": "COMPLETED",
                                                              "report": "COMPLETED"}, path
        report = json.loads((path / "eval" / "report.json").read_text())
        assert report["outcome"] == "complete" and report["checkpoint_step"] == step
        # evaluations while training run the trained policy only: reference rows do not change with the checkpoint
        assert report["eval"]["episodes_recorded"] == {"trained": 2}
        assert (run / "exports" / path.name / "model.safetensors").is_file()
        assert sorted(p.name for p in (path / "scripts").iterdir()) == ["eval.sbatch", "export.sbatch",
                                                                         "report.sbatch"]
    # the first evaluation ran beside training: its export was whole before training wrote its result
    assert (run / "exports" / "step-20" / "export.json").stat().st_mtime < \
        (run / "logs" / "train_result.json").stat().st_mtime
    assert not any(layout.pinned_by(run / "checkpoints" / f"step-{s}") for s in layout.list_steps(
        run / "checkpoints").complete)
    # one success-vs-step history for the run, with every evaluated step; MLflow children keyed by the step
    history = [json.loads(line) for line in (run / "eval" / "history.jsonl").read_text().splitlines()]
    assert sorted(h["step"] for h in history) == [20, 40, 60, 80]
    assert not any((p / "eval" / "history.jsonl").exists() for p in evals)
    uri = f"sqlite:///{runs_root.resolve() / 'mlflow.db'}"
    children = _children(uri, RunInfo.load(run).mlflow_run_id)
    assert sorted(name.rsplit(" ", 1)[0] for name in children) == [f"step {s} eval" for s in (20, 40, 60, 80)]
    assert len({name.rsplit(" ", 1)[1] for name in children}) == 1  # the same settings: one curve
    from embodyhpc.tracking.mlflow_run import client

    for name, child in children.items():
        history = client(uri).get_metric_history(child["run_id"], "eval/trained/success_rate")
        assert [m.step for m in history] == [int(name.split(" ")[1])]
    curve = client(uri).get_metric_history(RunInfo.load(run).mlflow_run_id, "eval/trained/success_rate")
    assert sorted(m.step for m in curve) == [20, 40, 60, 80]  # the learning curve on the training run
    text = cli("status", str(run)).out
    assert "evaluations while training:" in text
    assert "step-20: export COMPLETED, eval COMPLETED (2/2 done), report COMPLETED" in text
    assert set(json.loads(cli("status", str(run), "--json").out)["evals"]) == {"step-20", "step-40", "step-60"}
