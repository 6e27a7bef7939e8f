"""The chain as data (embodyhpc.orchestrate.plan) and the two backends that execute it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from embodyhpc.orchestrate.api import start_run
from embodyhpc.orchestrate.backend_local import LocalBackend
from embodyhpc.orchestrate.backend_slurm import dependency_args
from embodyhpc.orchestrate.plan import TASKS, JobSpec, chain_specs, make_plan, resolve_task
from embodyhpc.rundir import make_run_dir
from embodyhpc.runinfo import RunInfo
from embodyhpc.validation import load_recipe

RECIPE = "recipes/smoke_cpu.yaml"


def _loaded(tmp_path, *overrides: str):
    return load_recipe(RECIPE, [f"job.runs_root={tmp_path}", *overrides])


def test_training_chain_is_train_then_eval_array_then_report(tmp_path) -> None:
    plan = chain_specs(_loaded(tmp_path, "eval.shards=3", "eval.array_parallelism=2", "eval.every_k_checkpoints=2"))
    assert [(j.kind, j.task, j.after, j.condition, j.array_size, j.array_parallelism, j.starts_evals)
            for j in plan] == [
        ("train", "embodyhpc.launch.train:train_task", (), "afterok", 0, 0, True),
        ("eval", "embodyhpc.launch.eval:eval_shard_task", ("train",), "afterok", 3, 2, False),
        ("report", "embodyhpc.launch.report:report_task", ("train", "eval"), "afterany", 0, 0, False),
    ]
    assert [(j.kind, j.after, j.starts_evals) for j in chain_specs(_loaded(tmp_path, "eval.enabled=false"))] == [
        ("train", (), False), ("report", ("train",), False)]


def test_evaluation_of_a_checkpoint_exports_it_first(tmp_path) -> None:
    checkpoint = tmp_path / "run" / "checkpoints" / "step-40"
    plan = chain_specs(_loaded(tmp_path, f"eval.weights={checkpoint}"), eval_only=True)
    assert [(j.kind, j.after, j.condition) for j in plan] == [
        ("export", (), "afterok"), ("eval", ("export",), "afterok"), ("report", ("export", "eval"), "afterany")]
    export = tmp_path / "export"
    assert [j.kind for j in chain_specs(_loaded(tmp_path, f"eval.weights={export}"), eval_only=True)] == [
        "eval", "report"]


def test_every_task_name_resolves_to_a_function_and_the_package_imports_no_job_code() -> None:
    assert set(TASKS) == {"train", "rl", "export", "eval", "report", "smoke"}
    assert all(callable(resolve_task(name)) for name in TASKS.values())
    code = ("import sys, embodyhpc.orchestrate.api, embodyhpc.orchestrate.backend_local, "
            "embodyhpc.orchestrate.backend_slurm; print([m for m in sys.modules if m.startswith('embodyhpc.launch')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_slurm_dependencies_come_from_the_plan() -> None:
    ids = {"train": "11", "eval": "12"}
    assert dependency_args(JobSpec("train", "m:f"), ids) == []
    assert dependency_args(JobSpec("eval", "m:f", ("train",), "afterok", 4), ids) == [
        "--dependency=afterok:11", "--kill-on-invalid-dep=yes"]
    assert dependency_args(JobSpec("report", "m:f", ("train", "eval"), "afterany"), ids) == [
        "--dependency=afterany:11:12"]


def _local_run(tmp_path):
    loaded = _loaded(tmp_path)
    run = tmp_path / "exp" / "run"
    assert make_run_dir(run)
    return loaded, run, start_run(loaded, run, backend="local", python=sys.executable, mlflow_run_id=None)


@pytest.mark.slow
def test_the_local_backend_runs_any_plan_by_task_name(tmp_path) -> None:
    """Tasks named in the plan (here: the test's own), an array `array_parallelism` at a time, in order."""
    loaded, run, info = _local_run(tmp_path)
    plan = [JobSpec("export", "tests.orchestrate.tasks:record"),
            JobSpec("eval", "tests.orchestrate.tasks:record", ("export",), "afterok", 3, 2),
            JobSpec("report", "tests.orchestrate.tasks:record", ("export", "eval"), "afterany")]
    messages: list[str] = []
    LocalBackend().submit(make_plan(loaded, plan, run, info.python), info, progress=messages.append)
    assert (run / "calls.txt").read_text().splitlines() == ["True None", "True 0", "True 1", "True 2", "True None"]
    jobs = RunInfo.load(run).jobs
    assert {k: (r.state, r.dependency, r.array_size) for k, r in jobs.items()} == {
        "export": ("COMPLETED", None, 0), "eval": ("COMPLETED", "afterok:export", 3),
        "report": ("COMPLETED", "afterany:export:eval", 0)}
    assert jobs["eval"].array_counts == {"COMPLETED": 3} and len(jobs["eval"].element_ids) == 3
    assert "eval: 2/3 shards completed" in messages and "eval: 3/3 shards completed" in messages


@pytest.mark.slow
def test_the_local_backend_cancels_what_waits_on_a_failed_job(tmp_path) -> None:
    loaded, run, info = _local_run(tmp_path)
    plan = [JobSpec("export", "tests.orchestrate.tasks:fail"),
            JobSpec("eval", "tests.orchestrate.tasks:record", ("export",), "afterok", 2),
            JobSpec("report", "tests.orchestrate.tasks:record", ("export", "eval"), "afterany")]
    messages: list[str] = []
    LocalBackend().submit(make_plan(loaded, plan, run, info.python), info, progress=messages.append)
    jobs = RunInfo.load(run).jobs
    assert jobs["export"].state == "FAILED" and "fails on purpose" in jobs["export"].reason
    assert (jobs["eval"].state, jobs["eval"].reason, jobs["eval"].array_counts) == (
        "CANCELLED", "DependencyNeverSatisfied", {"CANCELLED": 2})
    assert jobs["report"].state == "COMPLETED"  # afterany: it records why the chain did not complete
    assert (run / "calls.txt").read_text().splitlines() == ["True None"]
    assert "eval: CANCELLED (export failed)" in messages
