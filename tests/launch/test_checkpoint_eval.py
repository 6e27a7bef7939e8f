"""Evaluations of checkpoints while training runs: which steps, the evaluation run each gets (recipe, pin, parent,
chain), the export job, and sbatch's environment when a job submits them."""

from __future__ import annotations

import pytest
import torch

from embodyhpc.checkpoint import layout
from embodyhpc.launch import checkpoint_eval
from embodyhpc.launch.export import export_task
from embodyhpc.orchestrate.plan import chain_kinds
from embodyhpc.rundir import requested_evals
from embodyhpc.runinfo import RunInfo
from embodyhpc.slurm.executor import without_job_environment
from embodyhpc.validation import load_recipe, load_resolved

RECIPE = "recipes/demo_metaworld_cpu.yaml"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _config(*overrides):
    return load_recipe(RECIPE, ["checkpoint.every_steps=200", "train.steps=1000", *overrides]).config


def test_every_kth_periodic_checkpoint_short_of_the_last_step():
    config = _config("eval.every_k_checkpoints=2")
    assert [s for s in range(0, 1201, 100) if checkpoint_eval.evaluates_step(config, s)] == [400, 800]
    never = _config("eval.every_k_checkpoints=0")
    assert not any(checkpoint_eval.evaluates_step(never, s) for s in range(1, 1001))
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
    assert (out / "policy_io.json").read_bytes() == (run / "checkpoints" / "policy_io.json").read_bytes()
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
