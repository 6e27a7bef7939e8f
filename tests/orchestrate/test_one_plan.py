"""Issue 30, item 2: one plan carries each job's shape and script; one dry run; backends behind one protocol.

Rendering and the chain's derivation are counted through the real code path with tools/walk.py's profiler (entries
into our functions), not by replacing any of our code. The expected counts come from the chain itself: one
rendered script per job the command prints (or submits), one derivation of the chain per command."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from pathlib import Path

import pytest

from embodyhpc.orchestrate import api, backend_local, backend_slurm
from embodyhpc.orchestrate.plan import chain_plan
from embodyhpc.rundir import make_run_dir
from embodyhpc.runinfo import JobRecord, RunInfo
from embodyhpc.validation import load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "smoke_cpu"  # train -> eval array -> report


def _walk_tool():
    spec = importlib.util.spec_from_file_location("walk_tool", ROOT / "tools" / "walk.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def walk():
    return _walk_tool()


def _counts(walk, fn) -> dict[str, int]:
    calls = walk.traced(fn).calls
    return {name: calls.get(name, 0) for name in ("_sbatch_context", "job_shape", "chain_kinds", "make_plan")}


def test_submit_dry_run_renders_each_job_once_and_derives_the_chain_once(cli, runs_root, walk):
    result = {}
    counts = _counts(walk, lambda: result.update(r=cli("submit", RECIPE, "--dry-run", f"job.runs_root={runs_root}")))
    out = result["r"].out
    assert result["r"].code == 0, result["r"].err
    jobs = out.count("#!/bin/bash")
    assert jobs == 3 and out.count("\n# sbatch ") == 3
    assert counts == {"_sbatch_context": jobs, "job_shape": jobs, "chain_kinds": 1, "make_plan": 1}


def test_submit_renders_each_job_once_and_sbatch_gets_the_plans_script(cli, runs_root, walk, tmp_path):
    """The Slurm backend end to end against a stand-in sbatch (tools/walk.py FAKE_SLURM; no Slurm runs): one
    render per job, and scripts/ holds what the stand-in's sbatch was handed (submitit's copy)."""
    result = {}
    with walk.fake_slurm(tmp_path / "bin"):
        counts = _counts(walk, lambda: result.update(r=cli("submit", RECIPE, f"job.runs_root={runs_root}",
                                                          "tracking.enabled=false")))
    assert result["r"].code == 0, result["r"].err
    run = Path(next(line.split(": ", 1)[1] for line in result["r"].out.splitlines()
                    if line.startswith("run directory: ")))
    info = RunInfo.load(run)
    assert info.backend == "slurm" and list(info.jobs) == ["train", "eval", "report"]
    assert counts == {"_sbatch_context": 3, "job_shape": 3, "chain_kinds": 1, "make_plan": 1}
    submitted = sorted((run / "submitit").glob("**/submission_file_*.sh")) or sorted(
        (run / "submitit").glob("**/*.sh"))
    assert {p.read_text() for p in submitted} == {(run / "scripts" / f"{k}.sbatch").read_text() for k in info.jobs}


def test_resume_dry_run_is_the_same_dry_run(runs_root, walk):
    """resume --dry-run goes through orchestrate.api.dry_run: the same sbatch lines (dependencies on placeholder
    ids) as submit's, one render per job."""
    from embodyhpc.resume import ResumePlan, dry_run

    loaded = load_recipe(RECIPE, [f"job.runs_root={runs_root}"])
    run = runs_root / "smoke" / "run-1"
    assert make_run_dir(run)
    info = RunInfo(run_id=run.name, run_dir=str(run), backend="slurm", recipe=RECIPE, site=None, overrides=[],
                   python=sys.executable, created="2026-01-01T00:00:00+0000")
    plan = ResumePlan(info, loaded, 20, ["train.steps=80"], {"train.steps": (40, 80)}, [])
    text = {}
    counts = _counts(walk, lambda: text.update(t=dry_run(plan, sys.executable)))
    lines = text["t"].splitlines()
    assert lines[0].startswith("# dry run: nothing submitted; attempt 2 of ")
    assert lines[1] == "#   train.steps: 40 -> 80"
    assert [line for line in lines if line.startswith("# sbatch ")] == [
        f"# sbatch {run}/scripts/train.sbatch",
        f"# sbatch --dependency=afterok:<train> --kill-on-invalid-dep=yes {run}/scripts/eval.sbatch",
        f"# sbatch --dependency=afterany:<train>:<eval> {run}/scripts/report.sbatch"]
    assert counts == {"_sbatch_context": 3, "job_shape": 3, "chain_kinds": 1, "make_plan": 1}


def test_the_plans_script_is_what_submitit_is_asked_to_submit(tmp_path):
    """The script is rendered once, with the command submitit's executor asks for; any other command is refused
    (nothing is submitted with a script that runs something else)."""
    from embodyhpc.errors import SlurmError
    from embodyhpc.rundir import submitit_folder
    from embodyhpc.slurm.executor import RecipeExecutor

    plan = chain_plan(load_recipe(RECIPE, []), tmp_path / "run", "/opt/my python/bin/python")
    for job in plan.jobs:
        ex = RecipeExecutor(submitit_folder(plan.run_dir), shape=job.shape, script=job.script, python=plan.python)
        assert ex._make_submission_file_text(ex._submitit_command_str, "uid") == job.script
        with pytest.raises(SlurmError, match="nothing submitted"):
            ex._make_submission_file_text(ex._submitit_command_str + " --other", "uid")


def _imports(module) -> list[tuple[str, bool]]:
    """Every import of a module (function-level ones too): (module name, under `if TYPE_CHECKING`)."""
    tree = ast.parse(inspect.getsource(module))
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and ast.unparse(block.test) == "TYPE_CHECKING" for node in ast.walk(block)}
    return [(node.module if isinstance(node, ast.ImportFrom) else alias.name, id(node) in typing_only)
            for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names]


def test_the_local_backend_neither_renders_nor_plans():
    """It runs the plan it is handed: no Slurm module, and the plan module for its types only."""
    found = _imports(backend_local)
    assert not [name for name, _ in found if name.startswith("embodyhpc.slurm")], found
    assert all(typing_only for name, typing_only in found if name == "embodyhpc.orchestrate.plan"), found


def test_both_backends_implement_the_protocol_and_api_names_no_backend():
    assert set(api.BACKENDS) == {"slurm", "local"}
    for name in api.BACKENDS:
        assert isinstance(api.backend(name), api.Backend), name
    strings = {node.value for node in ast.walk(ast.parse(inspect.getsource(api)))
               if isinstance(node, ast.Compare) for node in [*node.comparators, node.left]
               if isinstance(node, ast.Constant)}
    assert not strings & set(api.BACKENDS), f"api compares against a backend name: {strings & set(api.BACKENDS)}"
    assert isinstance(backend_slurm.SlurmBackend(), api.Backend) and isinstance(backend_local.LocalBackend(),
                                                                                 api.Backend)


def test_poll_reads_run_json_for_local_runs_and_for_slurm_runs_slurm_cannot_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # no sacct: read_states falls back to run.json
    jobs = {"train": JobRecord("train", job_id="77", state="COMPLETED"),
            "eval": JobRecord("eval", job_id="78", array_size=2, state="FAILED"),
            "report": JobRecord("report", job_id="79")}
    for name in api.BACKENDS:
        info = RunInfo(run_id="r", run_dir=str(tmp_path), backend=name, recipe="x", site=None, overrides=[],
                       python="python", created="now", jobs=dict(jobs))
        assert api.backend(name).poll(info) == {"train": "COMPLETED", "eval": "FAILED", "report": "UNKNOWN"}, name
