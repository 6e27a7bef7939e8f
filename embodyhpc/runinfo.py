"""run.json: a run's record (RunInfo: backend, job ids, attempts, local job states), its schema version, and the
strict reading of a file that may be old, hand-edited or someone else's (every field typed, bounded, one-line
errors naming the key). The run directory's names are embodyhpc/rundir.py's."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from embodyhpc.atomic import write_json_atomic
from embodyhpc.errors import RunDirError
from embodyhpc.job_ids import JOB_ID
from embodyhpc.rundir import EVALS_DIR, RUN_JSON, RUN_JSON_VERSION, shown, unreadable_error

EVALUATION_JOBS = frozenset({"export", "eval", "report"})
"""The jobs of an evaluation of weights that exist (no train job)."""


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
class Attempt:
    """One earlier attempt of a run: the submit (number 1) or a resume, with the jobs it ran."""

    number: int
    created: str
    backend: str
    site: str | None
    python: str
    overrides: list[str]
    """The key=value of the command that started it (submit: the run's overrides; resume: only its own)."""
    resumed_from_step: int | None = None
    """The checkpoint step it started from; None for the submit."""
    jobs: dict[str, JobRecord] = field(default_factory=dict)


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
    schema_version: int = RUN_JSON_VERSION
    """The layout this run.json was read in (RUN_JSON_VERSION); saving writes the current one."""
    driver: str | None = None
    """Local backend: `HOST:PID` of the process that runs the chain (the `embodyhpc submit` that started it). Once
    that process is gone, states run.json still calls active are stale (status says INTERRUPTED)."""
    attempt: int = 1
    """The number of the newest attempt, which `jobs`, `backend`, `site` and `python` describe (1: the submit)."""
    resumed_from_step: int | None = None
    """The newest attempt's starting checkpoint step (None: it is the submit)."""
    attempt_overrides: list[str] = field(default_factory=list)
    """The key=value the `resume` that started the newest attempt was given ([] for the submit)."""
    attempt_created: str | None = None
    """When the newest attempt started (None: `created`, the submit)."""
    attempts: list[Attempt] = field(default_factory=list)
    """The earlier attempts, oldest first, each with its jobs."""

    @property
    def kind(self) -> str:
        """What the run is, from its record: "checkpoint_eval" (an evaluation training asked for: parent_run),
        "eval" (`embodyhpc eval --ckpt`: a chain of export, eval and report jobs, no training), else "train" (a run
        whose jobs are not recorded yet counts as training; smoke runs too)."""
        if self.parent_run:
            return "checkpoint_eval"
        jobs = {kind for attempt in self.all_attempts() for kind in attempt.jobs}
        return "eval" if jobs and jobs <= EVALUATION_JOBS else "train"

    def all_attempts(self) -> list[Attempt]:
        """Every attempt, oldest first, the newest made of this record's own fields."""
        current = Attempt(number=self.attempt, created=self.attempt_created or self.created, backend=self.backend,
                          site=self.site, python=self.python,
                          overrides=list(self.attempt_overrides if self.attempt > 1 else self.overrides),
                          resumed_from_step=self.resumed_from_step, jobs=self.jobs)
        return [*self.attempts, current]

    def start_attempt(self, *, backend: str, site: str | None, python: str, overrides: list[str],
                      resumed_from_step: int, created: str) -> None:
        """Move the newest attempt (with its jobs) to `attempts` and describe a new one with no jobs yet."""
        self.attempts = self.all_attempts()
        self.attempt += 1
        self.jobs = {}
        self.backend, self.site, self.python = backend, site, python
        self.attempt_overrides, self.resumed_from_step = list(overrides), resumed_from_step
        self.attempt_created = created
        self.driver = None  # the new attempt's chain records its own

    def save(self) -> None:
        self.schema_version = RUN_JSON_VERSION
        write_json_atomic(Path(self.run_dir) / RUN_JSON, asdict(self))

    @classmethod
    def load(cls, run_dir: str | Path) -> RunInfo:
        """The run in `run_dir`, checked field by field (a damaged run.json is a one-line RunDirError).

        The run is the folder it was loaded from, not the path stored inside: a run folder that was moved or
        copied keeps working (its evaluations while training, under evals/, find their parent the same way).
        Keys this version does not know are ignored (a newer embodyhpc may have written them)."""
        folder = Path(run_dir).expanduser().absolute()
        path = folder / RUN_JSON
        try:
            path.lstat()  # not exists(): that raises for a folder of someone else's (EACCES) or a name too long
        except (FileNotFoundError, NotADirectoryError):
            raise RunDirError("not an embodyhpc run directory (no run.json)", where=shown(str(run_dir)),
                              fix="pass the folder `embodyhpc submit` printed") from None
        except OSError as exc:
            raise unreadable_error(folder, exc, where=str(run_dir)) from None
        data = _read_run_json(path)
        fields = _fields({k: v for k, v in data.items() if k != "jobs"}, _RUN_FIELDS, path, "")
        records = _checked(data, "jobs", dict, path)
        jobs = _job_records(records, path, "jobs")
        raw_attempts = data.get("attempts", [])
        if not isinstance(raw_attempts, list):
            raise _damaged(path, f"a {_json_type(raw_attempts)} where an array belongs", key="attempts")
        if len(raw_attempts) > MAX_ATTEMPTS:
            raise _damaged(path, f"{len(raw_attempts)} attempts, more than embodyhpc records", key="attempts")
        attempts = []
        for i, item in enumerate(raw_attempts):
            where = f"attempts[{i}]"
            if not isinstance(item, dict):
                raise _damaged(path, f"a {_json_type(item)} where an object belongs", key=where)
            found = _fields({k: v for k, v in item.items() if k != "jobs"}, _ATTEMPT_FIELDS, path, where)
            attempts.append(Attempt(**found, jobs=_job_records(item.get("jobs", {}), path, f"{where}.jobs")))
        info = cls(**{"schema_version": 1, **fields, "run_dir": str(folder)}, jobs=jobs, attempts=attempts)
        numbers = [attempt.number for attempt in attempts]
        if numbers != list(range(1, len(attempts) + 1)) or info.attempt != len(attempts) + 1:
            raise _damaged(path, f"attempt {info.attempt} after earlier attempts numbered "
                                 f"{numbers[:10] or 'none'}: each resume records the one before it (1, 2, ...)",
                           key="attempt")
        if info.parent_run is not None and folder.parent.name == EVALS_DIR:
            info.parent_run = str(folder.parent.parent)
        return info


MAX_RUN_JSON_BYTES = 4 << 20  # embodyhpc writes a few KiB; more is not a run.json of ours
MAX_JOBS = 64  # job records in one run.json: a chain has at most five (train or export, eval, report, smoke)
MAX_ATTEMPTS = 1000  # attempts of one run (each a resume)
_NO_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_FIX = "restore run.json from a backup, or submit the recipe again (run.json is written by `embodyhpc submit`)"

# field: (types, required); str fields refuse control characters, job ids must be numeric
_RUN_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "run_id": ((str,), True), "run_dir": ((str,), False), "backend": ((str,), True), "recipe": ((str,), True),
    "site": ((str, type(None)), True), "overrides": ((list,), True), "python": ((str,), True),
    "created": ((str,), True), "mlflow_run_id": ((str, type(None)), False), "parent_run": ((str, type(None)), False),
    "schema_version": ((int,), False), "attempt": ((int,), False),
    "resumed_from_step": ((int, type(None)), False), "attempt_overrides": ((list,), False),
    "attempt_created": ((str, type(None)), False), "driver": ((str, type(None)), False),
}
_ATTEMPT_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "number": ((int,), True), "created": ((str,), True), "backend": ((str,), True), "site": ((str, type(None)), True),
    "python": ((str,), True), "overrides": ((list,), True), "resumed_from_step": ((int, type(None)), False),
}
_JOB_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "kind": ((str,), True), "job_id": ((str, type(None)), False), "array_size": ((int,), False),
    "dependency": ((str, type(None)), False), "state": ((str, type(None)), False),
    "reason": ((str, type(None)), False), "exit_code": ((int, type(None)), False),
    "element_ids": ((list,), False), "array_counts": ((dict,), False),
}


def _job_records(records: Any, path: Path, where: str) -> dict[str, JobRecord]:
    if not isinstance(records, dict):
        raise _damaged(path, f"a {_json_type(records)} where an object belongs", key=where)
    if len(records) > MAX_JOBS:
        raise _damaged(path, f"{len(records)} job records, more than a run of embodyhpc has", key=where)
    return {name: JobRecord(**_fields(record, _JOB_FIELDS, path, f"{where}.{name}"))
            for name, record in records.items()}


def _damaged(path: Path, problem: str, key: str | None = None) -> RunDirError:
    return RunDirError(f"damaged run.json: {problem}", where=str(path), key=key, fix=_FIX)


def _read_run_json(path: Path) -> dict:
    """The parsed object, read with a size cap; never echoes the content."""
    if path.is_dir():
        raise _damaged(path, "it is a directory, not a file")
    if path.exists() and not path.is_file():  # reading a FIFO would wait forever, a device never end
        raise _damaged(path, "not a regular file (a FIFO, socket or device)")
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_RUN_JSON_BYTES + 1)
    except PermissionError as exc:
        raise unreadable_error(path, exc, where=str(path), what=RUN_JSON) from None
    except OSError as exc:
        raise RunDirError(f"cannot read run.json: {exc.strerror or exc}", where=str(path),
                          fix="check the file's permissions and that its filesystem is mounted") from exc
    if len(raw) > MAX_RUN_JSON_BYTES:
        raise _damaged(path, f"larger than {MAX_RUN_JSON_BYTES >> 20} MiB, far more than embodyhpc writes")
    if not raw.strip():
        raise _damaged(path, "the file is empty")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise _damaged(path, "not text (binary content)") from exc
    except (ValueError, RecursionError) as exc:
        line = f" at line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise _damaged(path, f"not valid JSON{line} (truncated or overwritten?)") from exc
    if not isinstance(data, dict):
        raise _damaged(path, f"a JSON {_json_type(data)} instead of an object")
    return data


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number run.json holds")


def _json_type(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _checked(data: dict, key: str, kind: type, path: Path) -> Any:
    if key not in data:
        raise _damaged(path, "missing", key=key)
    value = data[key]
    if not isinstance(value, kind):
        raise _damaged(path, f"a {_json_type(value)} where a {_json_type(kind())} belongs", key=key)
    return value


def _fields(data: Any, spec: dict[str, tuple[tuple[type, ...], bool]], path: Path, prefix: str) -> dict[str, Any]:
    """The known fields of `data`, each of its declared type; unknown keys are dropped."""
    if not isinstance(data, dict):
        raise _damaged(path, f"a {_json_type(data)} where an object belongs", key=prefix or None)
    out: dict[str, Any] = {}
    for key, (types, required) in spec.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in data:
            if required:
                raise _damaged(path, "missing", key=name)
            continue
        value = data[key]
        if not isinstance(value, types) or isinstance(value, bool):
            want = " or ".join(_json_type(t() if t is not type(None) else None) for t in types)
            raise _damaged(path, f"a {_json_type(value)} where a {want} belongs", key=name)
        _check_value(key, value, path, name)
        out[key] = value
    return out


def _check_value(key: str, value: Any, path: Path, name: str) -> None:
    if key in ("schema_version", "attempt", "number") and isinstance(value, int) and value < 1:
        raise _damaged(path, f"{value}, but {'versions' if key == 'schema_version' else 'attempts'} count from 1",
                       key=name)
    if key == "backend" and value not in ("slurm", "local"):
        raise _damaged(path, "neither slurm nor local", key=name)
    if isinstance(value, int) and not 0 <= value < (1 << 31) and not (key == "exit_code" and -256 < value < 0):
        raise _damaged(path, "out of range", key=name)
    if isinstance(value, dict) and any(not isinstance(n, int) or isinstance(n, bool) or n < 0
                                       for n in value.values()):
        raise _damaged(path, "counts must be whole numbers >= 0", key=name)
    texts = list(value) if isinstance(value, (list, dict)) else [value] if isinstance(value, str) else []
    for text in texts:
        if not isinstance(text, str):
            raise _damaged(path, f"a {_json_type(text)} in a list of strings", key=name)
        if key not in ("overrides", "attempt_overrides") and _NO_CONTROL.search(text):
            raise _damaged(path, "holds control characters", key=name)
        if key in ("job_id", "element_ids") and not JOB_ID.fullmatch(text):
            raise _damaged(path, "not a Slurm job id (digits, or digits_digits for an array element)", key=name)
