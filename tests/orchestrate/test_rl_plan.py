"""The RL run's plan: rl replaces train in the chain, its job shape holds the heterogeneous groups (actor, rollout,
env) from rl.resources, and the Slurm backend submits it through embodyhpc.slurm.hetjob (sbatch --parsable), not
submitit. Expected numbers are read off recipes/rl_pi05_libero.yaml by hand (its comments say the same)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from embodyhpc.orchestrate.api import dry_run
from embodyhpc.orchestrate.backend_slurm import SlurmBackend
from embodyhpc.orchestrate.plan import HetGroup, chain_plan, chain_specs, kind_plan
from embodyhpc.rundir import make_run_dir
from embodyhpc.runinfo import RunInfo
from embodyhpc.slurm import commands, hetjob
from embodyhpc.validation import load_recipe

RECIPE = "rl_pi05_libero"
OVERRIDES = ["model.init_weights=/models/pi05_libero_sft", "model.tokenizer_path=/models/paligemma/tokenizer.model"]
RUN_DIR = Path("/runs/rl/rl-20260101-000000")
PYTHON = "/opt/venv/bin/python"
# rl.resources of the recipe: actor 16 ranks on 2 nodes x 8 GPUs, 12 cpus, mem 0; rollout 8 workers on 1 node x 8
# GPUs, 8 cpus; env 2 nodes x 4 workers (rl.env_workers is per node), 8 cpus, 64G
GROUPS = (HetGroup("actor", 2, 8, 12, "0", 8, None), HetGroup("rollout", 1, 8, 8, "0", 8, None),
          HetGroup("env", 2, 4, 8, "64G", 0, None))


@pytest.fixture(scope="module")
def loaded():
    return load_recipe(RECIPE, OVERRIDES, site="local")


def test_rl_replaces_train_in_the_chain(loaded):
    assert [(j.kind, j.task, j.after, j.condition) for j in chain_specs(loaded)] == [
        ("rl", "embodyhpc.launch.rl:rl_task", (), "afterok"),
        ("eval", "embodyhpc.launch.eval:eval_shard_task", ("rl",), "afterok"),
        ("report", "embodyhpc.launch.report:report_task", ("rl", "eval"), "afterany")]
    no_eval = load_recipe(RECIPE, [*OVERRIDES, "eval.enabled=false"], site="local")
    assert [(j.kind, j.after) for j in chain_specs(no_eval)] == [("rl", ()), ("report", ("rl",))]
    plain = load_recipe("smoke_cpu", site="local")  # a supervised recipe keeps its train job, without groups
    assert [j.kind for j in chain_specs(plain)] == ["train", "eval", "report"]
    assert all(not job.shape.groups for job in kind_plan(plain, "train", RUN_DIR, PYTHON).jobs)
    # the dry run hands the evaluation the rl job's id as its dependency
    args = {job.kind: job.sbatch_args for job in dry_run(chain_plan(loaded, RUN_DIR, PYTHON)).jobs}
    assert args["rl"] == [] and args["eval"] == ["--dependency=afterok:<rl>", "--kill-on-invalid-dep=yes"]


def test_rl_job_shape_holds_the_groups_in_order_and_one_allocation_for_the_fallback(loaded):
    shape = kind_plan(loaded, "rl", RUN_DIR, PYTHON).jobs[0].shape
    assert shape.groups == GROUPS
    assert shape.tasks == 16 + 8 + 8 and shape.env["EMBODYHPC_RL_SIZES"] == "actor=16,rollout=8,env=8"
    # site.het_jobs: false: 5 nodes, each sized for the largest group (8 tasks, 12 cpus, all memory, 8 GPUs)
    assert (shape.nodes, shape.tasks_per_node, shape.cpus_per_task, shape.mem, shape.gpus) == (5, 8, 12, "0", 8)
    assert shape.time_min == 48 * 60 and shape.signal_delay_s == 300 and shape.max_requeues == 3
    assert shape.env["EMBODYHPC_JOB_KIND"] == "rl" and shape.env["EMBODYHPC_RUN_DIR"] == str(RUN_DIR)
    # the RL job runs its module, not submitit's
    assert shlex.split(shape.command) == [PYTHON, "-u", "-m", "embodyhpc.launch.rl", str(RUN_DIR)]
    small = load_recipe(RECIPE, [*OVERRIDES, "rl.resources.env.mem=500M", "rl.resources.actor.mem=2G",
                                 "rl.resources.rollout.mem=1024M"], site="local")
    assert kind_plan(small, "rl", RUN_DIR, PYTHON).jobs[0].shape.mem == "2G"  # 2048 MB > 1024 MB > 500 MB


def test_a_recipe_without_rl_has_no_rl_job():
    from embodyhpc.errors import ConfigError

    with pytest.raises(ConfigError, match="rl.enabled"):
        kind_plan(load_recipe("smoke_cpu", site="local"), "rl", RUN_DIR, PYTHON)


def test_the_slurm_backend_submits_the_het_job_with_sbatch_not_submitit(loaded, tmp_path, monkeypatch):
    calls = []

    def sbatch(args, **kwargs):
        calls.append(args)
        return "4242;local\n"

    monkeypatch.setattr(commands, "run", sbatch)
    run = tmp_path / "run"
    assert make_run_dir(run)
    plan = kind_plan(loaded, "rl", run, PYTHON)
    info = RunInfo(run_id=run.name, run_dir=str(run), backend="slurm", recipe=RECIPE, site="local",
                   overrides=[], python=PYTHON, created="2026-01-01T00:00:00+0000")
    SlurmBackend().submit(plan, info, progress=lambda message: None)
    job = plan.jobs[0]
    assert calls == [["sbatch", "--parsable", str(job.script_path)]]
    assert job.script_path.read_text() == job.script  # what sbatch read is the plan's script
    record = RunInfo.load(run).jobs["rl"]
    assert (record.job_id, record.array_size, record.dependency) == ("4242", 0, None)
    # a later job of a chain waits with the dependency options every job gets
    calls.clear()
    record = hetjob.submit(job, run, info, ["--dependency=afterok:7", "--kill-on-invalid-dep=yes"])
    assert calls == [["sbatch", "--parsable", "--dependency=afterok:7", "--kill-on-invalid-dep=yes",
                      str(job.script_path)]]
    assert record.dependency == "afterok:7"
    monkeypatch.setattr(commands, "run", lambda args, **kwargs: "sbatch: error: Batch job submission failed\n")
    from embodyhpc.errors import SlurmError

    with pytest.raises(SlurmError, match="not a job id"):
        hetjob.submit(job, run, info, [])
