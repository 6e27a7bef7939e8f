"""The run directory: everything one `submit` produced, on the parallel filesystem.

    <runs_root>/<experiment>/<name>-<YYYYmmdd-HHMMSS>/
        resolved.yaml       the frozen config every job reads
        run.json            backend, job ids and (local backend) job states
        scripts/            the sbatch text handed to Slurm, one file per job
        submitit/           submitit's pickles and per-task logs
        checkpoints/  eval/  logs/
        evals/step-N/       evaluations of checkpoints while training ran (eval.every_k_checkpoints): run
                            directories of their own (export -> eval -> report), with `parent_run` set
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from embodyhpc.errors import RunDirError

RUN_JSON = "run.json"
RESOLVED_YAML = "resolved.yaml"
SUBDIRS = ("scripts", "submitit", "checkpoints", "eval", "logs")


@dataclass
class JobRecord:
    kind: str  # train | eval | report
    job_id: str | None = None
    array_size: int = 0
    dependency: str | None = None
    # local backend only: Slurm keeps these for the slurm backend
    state: str | None = None
    reason: str | None = None
    exit_code: int | None = None
    element_ids: list[str] = field(default_factory=list)  # local arrays: one process per element
    array_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class RunInfo:
    run_id: str
    run_dir: str
    backend: str  # slurm | local
    recipe: str
    site: str | None
    overrides: list[str]
    python: str
    created: str
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    mlflow_run_id: str | None = None
    parent_run: str | None = None
    """For an evaluation of a checkpoint while training ran: the training run directory (its history and plots
    collect this evaluation's numbers)."""

    def save(self) -> None:
        write_json_atomic(Path(self.run_dir) / RUN_JSON, asdict(self))

    @classmethod
    def load(cls, run_dir: str | Path) -> RunInfo:
        path = Path(run_dir) / RUN_JSON
        if not path.is_file():
            raise RunDirError("not an embodyhpc run directory (no run.json)", where=str(run_dir),
                              fix="pass the folder `embodyhpc submit` printed")
        data = json.loads(path.read_text())
        data["jobs"] = {k: JobRecord(**v) for k, v in data.get("jobs", {}).items()}
        return cls(**data)


def write_json_atomic(path: Path, data: Any) -> None:
    """Readers (status, the report job) never see a half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def new_run_dir(runs_root: str, experiment: str, name: str) -> Path:
    """A fresh, unique folder; the name sorts by creation time."""
    parent = Path(runs_root).expanduser().resolve() / experiment
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(1000):
        path = parent / (f"{name}-{stamp}" if attempt == 0 else f"{name}-{stamp}-{attempt}")
        if make_run_dir(path):
            return path
    raise RunDirError("could not create a unique run directory", where=str(parent))


def make_run_dir(path: Path) -> bool:
    """Create `path` with the run subfolders; False when it exists already (someone else made it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)  # private: scripts, logs and pickles can hold what the job's environment holds
    except FileExistsError:
        return False
    path.chmod(0o700)  # mkdir's mode is masked by the umask; 0700 is what we mean whatever the umask
    for sub in SUBDIRS:
        (path / sub).mkdir(mode=0o700)
    return True


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600): resolved configs and scripts of a run."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
