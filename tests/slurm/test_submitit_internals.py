"""The submitit internals embodyhpc.slurm.executor relies on. If one of these fails after a
submitit upgrade, re-check RecipeExecutor before widening the pin in pyproject.toml."""

from __future__ import annotations

import inspect
from importlib.metadata import version
from pathlib import Path

from submitit.core import core, utils
from submitit.slurm import slurm

from embodyhpc.slurm.render import log_paths, submitit_command


def test_pinned_version():
    assert version("submitit").startswith("1.5."), "RecipeExecutor was written against submitit 1.5.x"


def test_private_hooks_exist_with_expected_signatures():
    sig = inspect.signature(slurm.SlurmExecutor._make_submission_file_text)
    assert list(sig.parameters) == ["self", "command", "uid"]
    assert list(inspect.signature(slurm.SlurmExecutor._make_submission_command).parameters) == [
        "self", "submission_file_path"]
    assert list(inspect.signature(core.PicklingExecutor._internal_process_submissions).parameters) == [
        "self", "delayed_submissions"]
    assert hasattr(utils.JobPaths, "get_first_id_independent_folder")
    assert list(inspect.signature(utils.DelayedSubmission.set_timeout).parameters) == [
        "self", "timeout_min", "max_num_timeout"]
    # the base submit path writes the text our hook returns, then runs our command list
    source = inspect.getsource(core.PicklingExecutor._submit_command)
    assert "_make_submission_file_text(command, tmp_uuid)" in source
    assert "_make_submission_command(submission_file_path)" in source


def test_command_and_log_paths_match_submitit(tmp_path):
    """render.py derives submitit's command and log paths itself (render must not import submitit)."""
    ex = slurm.SlurmExecutor.__new__(slurm.SlurmExecutor)
    ex.folder = (tmp_path / "run" / "submitit").absolute()
    ex.python = "'/my python'"
    assert ex._submitit_command_str == submitit_command("/my python", tmp_path / "run")
    paths = utils.JobPaths(folder=ex.folder)
    assert (str(paths.stdout), str(paths.stderr)) == log_paths(tmp_path / "run", array=False)
    sbatch = slurm._make_sbatch_string(command="x", folder=ex.folder, map_count=3)
    out, err = log_paths(tmp_path / "run", array=True)
    assert f"--output={out.replace('%t', '0')}" in sbatch and f"--error={err.replace('%t', '0')}" in sbatch
    assert "--signal=USR2@" in sbatch and slurm.SlurmJobEnvironment.USR_SIG == "USR2"


def test_submit_module_is_what_jobs_run():
    import importlib

    module = importlib.import_module("submitit.core._submit")
    assert Path(module.__file__).name == "_submit.py"
