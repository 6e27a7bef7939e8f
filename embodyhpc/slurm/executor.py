"""submitit's Slurm executor, with our rendered template as the sbatch text.

submitit keeps doing what it is good at (pickling the task, requeue on timeout/preemption,
job paths, result files); the script text is the plan's (rendered once by `render.render_jobs`, with the
command submitit runs: `render.submitit_command`), so what `embodyhpc render` prints is what sbatch
receives. Should submitit ever ask for another command than the one the script was rendered with, the
submission is refused rather than sent with a script that runs something else. Dependencies go on the
sbatch command line, which keeps the script text independent of job ids.

This overrides private submitit methods (`_make_submission_file_text`,
`_make_submission_command`, the array branch of `_internal_process_submissions`); the
submitit range is pinned in pyproject.toml and tests/slurm/test_submitit_internals.py fails
loudly when their signatures or behaviour change.
"""

from __future__ import annotations

import os
import shlex
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from submitit.core import utils as submitit_utils
from submitit.slurm.slurm import SlurmExecutor, SlurmJob

from embodyhpc.errors import SlurmError
from embodyhpc.slurm.render import JobShape


class RecipeExecutor(SlurmExecutor):
    def __init__(self, folder: Path, *, shape: JobShape, script: str, python: str,
                 sbatch_args: list[str] | None = None, max_num_timeout: int = 3) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout, python=shlex.quote(python))
        self._shape = shape
        self._script = script
        self._sbatch_args = list(sbatch_args or [])
        # submitit reads these for the task count, timeouts and the array's size
        self.update_parameters(nodes=shape.nodes, ntasks_per_node=shape.tasks_per_node,
                               time=shape.time_min, array_parallelism=max(shape.array_parallelism, 1))

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        if command != self._shape.command:
            raise SlurmError(f"submitit asks to run {command!r}, but the {self._shape.kind} script was rendered to "
                             f"run {self._shape.command!r}: nothing submitted (is the submitit version the one "
                             "pyproject.toml pins?)")
        return self._script

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return [*without_job_environment(os.environ), "sbatch", *self._sbatch_args, str(submission_file_path)]

    def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
        if not self._shape.array_size:
            if len(delayed_submissions) != 1:
                raise ValueError("a non-array job takes exactly one submission")
            return super()._internal_process_submissions(delayed_submissions)
        # submitit's own array branch builds a fresh SlurmExecutor (our template would be lost)
        count = len(delayed_submissions)
        if count != self._shape.array_size:
            raise ValueError(f"the rendered array has {self._shape.array_size} elements, got {count} tasks")
        folder = submitit_utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        pickles = []
        for delayed in delayed_submissions:
            path = folder / f"{uuid.uuid4().hex}.pkl"
            delayed.set_timeout(self.parameters["time"], self.max_num_timeout)
            delayed.dump(path)
            pickles.append(path)
        first = self._submit_command(self._submitit_command_str)
        tasks = list(range(first.num_tasks))
        jobs = [SlurmJob(folder=self.folder, job_id=f"{first.job_id}_{i}", tasks=tasks) for i in range(count)]
        for job, path in zip(jobs, pickles, strict=True):
            job.paths.move_temporary_file(path, "submitted_pickle")
        return jobs


# what a running job's environment holds about that job: sbatch would pass it on to the job it submits (it exports
# the caller's environment), where srun and torch.distributed would read the parent's tasks, ranks and rendezvous
_JOB_PREFIXES = ("SLURM_", "SLURMD_", "SRUN_", "SUBMITIT_")
_JOB_NAMES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
_KEEP = ("SLURM_CONF",)  # where the cluster's configuration is: sbatch needs it as much as the job did


def without_job_environment(environ: Mapping[str, str]) -> list[str]:
    """`env -u NAME ...` for a submission from inside a job (the training job submits evaluations of its
    checkpoints); nothing elsewhere, where SBATCH_* and the like are the user's own settings. A prefix for sbatch's
    command line rather than changes to os.environ, which the submitting job's other threads share."""
    if "SLURM_JOB_ID" not in environ:
        return []
    names = sorted(n for n in environ if (n.startswith(_JOB_PREFIXES) or n in _JOB_NAMES) and n not in _KEEP)
    return ["env", *[arg for name in names for arg in ("-u", name)]]
