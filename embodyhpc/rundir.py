"""The run directory: everything one `submit` produced, on the parallel filesystem.

    <runs_root>/<experiment>/<name>-<YYYYmmdd-HHMMSS>/
        resolved.yaml       the frozen config every job reads
        run.json            backend, job ids and (local backend) job states (embodyhpc/runinfo.py reads and
                            writes it)
        scripts/            the sbatch text handed to Slurm, one file per job
        submitit/           submitit's pickles and per-task logs
        checkpoints/        step-N folders (embodyhpc.checkpoint.layout owns what is inside one), policy_io.json
        exports/step-N/     checkpoints exported for evaluation (by the export job of an evaluation of step-N)
        export/             the final export of training (an evaluation run: the export job's fallback folder)
        logs/               metrics.jsonl, train_result.json, flight-recorder/<job id>/rank_N (torch's NCCL
                            flight-recorder dumps of a hung collective, one folder per job)
        eval/               shards/<policy>/shard-NNNN.jsonl, videos/, report.json|md|txt, history.jsonl, plots/
        evals/step-N/       evaluations of checkpoints while training ran (eval.every_k_checkpoints): run
                            directories of their own (export -> eval -> report), with `parent_run` set
        smoke-request.json, smoke.json      `embodyhpc smoke --submit`: what was asked, what the job measured
        attempts/N/         what attempt N (1: the submit) left behind when `embodyhpc resume` started attempt N+1:
                            its resolved.yaml, scripts/, export/ and evaluation results (eval/shards, videos,
                            report.*); run.json keeps its jobs under `attempts`. attempts/.N.staging-<hex>: what a
                            resume gathers before one rename makes it attempts/N (embodyhpc.attempts)
        .embodyhpc.lock     the lock commands that change the run take, naming its holder (embodyhpc.runlock)

This module is the only one that spells a name in that tree; everything else asks for it here. Every JSON file of
a run is written through `write_json_atomic` (embodyhpc/atomic.py).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from embodyhpc.atomic import replace_atomically
from embodyhpc.errors import RunDirError, RunFailure, UnreadableRunError

RUN_JSON = "run.json"
RUN_JSON_VERSION = 3
"""The layout of run.json. 1: files written before it carried `schema_version`. Readers ignore keys they do not
know, so a newer writer may add fields without a new version; a new version means a field changed meaning.
3: `jobs`, `backend`, `site` and `python` describe the newest attempt (`embodyhpc resume` starts another); the
earlier ones are under `attempts`. Versions 1 and 2 read as a run of one attempt. A writer that rewrites run.json
(`resume`) refuses a newer version than its own: it would drop what it does not know."""
RESOLVED_YAML = "resolved.yaml"
SCRIPTS_DIR = "scripts"
SUBMITIT_DIR = "submitit"
CHECKPOINTS_DIR = "checkpoints"
EXPORTS_DIR = "exports"  # <run>/exports/step-N: a checkpoint exported for evaluation, beside checkpoints/
EXPORT_DIR = "export"
EVAL_DIR = "eval"
LOGS_DIR = "logs"
EVALS_DIR = "evals"  # <run>/evals/step-N: evaluations while training (embodyhpc.launch.checkpoint_eval)
ATTEMPTS_DIR = "attempts"  # <run>/attempts/N: what attempt N left behind when a resume started the next one
SUBDIRS = (SCRIPTS_DIR, SUBMITIT_DIR, CHECKPOINTS_DIR, EVAL_DIR, LOGS_DIR)

METRICS_FILE = f"{LOGS_DIR}/metrics.jsonl"
RESULT_FILE = f"{LOGS_DIR}/train_result.json"
ATTEMPTS_FILE = f"{LOGS_DIR}/train_attempts.jsonl"
SPINE_STATE_FILE = f"{CHECKPOINTS_DIR}/spine-state.pt"  # the training job's own state across requeues
POLICY_IO_FILE = "policy_io.json"  # in checkpoints/ and in every export: what the policy reads and writes
SHARDS_DIR = f"{EVAL_DIR}/shards"
VIDEOS_DIR = f"{EVAL_DIR}/videos"
REPORT_FILE = f"{EVAL_DIR}/report.json"
SUMMARY_FILE = f"{EVAL_DIR}/report.md"
TABLE_FILE = f"{EVAL_DIR}/report.txt"
HISTORY_FILE = f"{EVAL_DIR}/history.jsonl"
PLOTS_DIR = f"{EVAL_DIR}/plots"
SMOKE_FILE = "smoke.json"
SMOKE_REQUEST_FILE = "smoke-request.json"
FLIGHT_RECORDER_DIR = f"{LOGS_DIR}/flight-recorder"
FLIGHT_RECORDER_FILE_PREFIX = "rank_"  # torch appends the rank: rank_0, rank_1 ... (what torchfrtrace reads)

STEP_PREFIX = "step-"
_STEP_RE = re.compile(rf"{STEP_PREFIX}(0|[1-9][0-9]*)", re.ASCII)  # the one spelling step_name writes
MAX_STEP = (1 << 63) - 1
"""The largest step a checkpoint may hold: ranks agree on steps as int64 tensors (torch.distributed)."""


def step_name(step: int) -> str:
    """The folder name of step N, under checkpoints/, exports/ and evals/."""
    return f"{STEP_PREFIX}{step}"


def parse_step(name: str) -> int | None:
    """The step of a `step-N` folder name exactly as step_name writes it; None for anything else: `step-0004`,
    `step-+4`, `step-4 ` or `step-4\\n`, digits other than ASCII's, a step past MAX_STEP. The planner (`resume`,
    `eval --ckpt`) and the loader (the training job) read folder names through this one function, so whatever one
    accepts the other finds under the same name (embodyhpc.checkpoint.layout says why a near miss is not a step)."""
    match = _STEP_RE.fullmatch(name)
    if not match or len(match.group(1)) > 19:
        return None
    step = int(match.group(1))
    return step if step <= MAX_STEP else None


def script_file(run_dir: Path, kind: str) -> Path:
    """The sbatch text of one job of the chain (what Slurm got; a local run writes it for reference)."""
    return Path(run_dir) / SCRIPTS_DIR / f"{kind}.sbatch"


def submitit_folder(run_dir: Path) -> Path:
    return Path(run_dir) / SUBMITIT_DIR


def shard_file(run_dir: Path, policy: str, shard: int) -> Path:
    """One evaluation shard's episode records for one policy."""
    return Path(run_dir) / SHARDS_DIR / policy / f"shard-{shard:04d}.jsonl"


def shard_files(run_dir: Path) -> list[Path]:
    """Every shard file the evaluation array wrote, sorted."""
    root = Path(run_dir) / SHARDS_DIR
    return sorted(root.glob("*/shard-*.jsonl")) if root.is_dir() else []


def eval_run_dir(run: Path, step: int) -> Path:
    """The run directory of the evaluation of step N while training ran."""
    return Path(run) / EVALS_DIR / step_name(step)


def requested_evals(run: Path) -> list[Path]:
    """The evaluation run directories under <run>/evals/ that are ready (run.json written), by step."""
    root = Path(run) / EVALS_DIR
    try:
        names = os.listdir(root)
    except OSError:  # none yet, or a folder this user cannot read: no evaluation to show (os.path never raises)
        return []
    found = [(parse_step(name), root / name) for name in names if os.path.isfile(root / name / RUN_JSON)]
    return [path for step, path in sorted((s, p) for s, p in found if s is not None)]


def attempt_dir(run: Path, number: int) -> Path:
    """Where attempt `number`'s resolved config, scripts, export and evaluation results go when a resume starts the
    next attempt (embodyhpc.resume)."""
    return Path(run) / ATTEMPTS_DIR / str(number)


_STAGING_RE = re.compile(r"\.([1-9][0-9]{0,8})\.staging-[0-9a-f]{8,32}", re.ASCII)


def attempt_staging_dir(run: Path, number: int, token: str) -> Path:
    """Where a resume gathers attempt `number`'s outputs before one rename makes them attempts/<number>: a hidden
    folder beside it (same filesystem, so the rename is atomic); `token` is hex."""
    return Path(run) / ATTEMPTS_DIR / f".{number}.staging-{token}"


def staged_attempts(run: Path) -> list[tuple[int, Path]]:
    """(attempt number, folder) of every staging folder a resume left (one that crashed mid-way), by number."""
    try:
        names = os.listdir(Path(run) / ATTEMPTS_DIR)
    except OSError:
        return []
    found = [(_STAGING_RE.fullmatch(name), name) for name in names]
    return sorted((int(m.group(1)), Path(run) / ATTEMPTS_DIR / name) for m, name in found if m)


LOCK_FILE = ".embodyhpc.lock"
"""The file commands that change a run folder lock (embodyhpc.runlock); it also names who holds it."""


ATTEMPT_OUTPUTS = (RESOLVED_YAML, SCRIPTS_DIR, EXPORT_DIR, SHARDS_DIR, VIDEOS_DIR, REPORT_FILE, SUMMARY_FILE,
                   TABLE_FILE)
"""What one attempt writes that the next would overwrite or mix with its own (a report of 4 shards must not read a
5th an earlier attempt left); a resume moves them under attempts/N. Checkpoints, logs/metrics.jsonl (cut back to the
resumed step by its writer), eval/history.jsonl and evals/ belong to the run and stay."""


def flight_recorder_prefix(run_dir: Path, job_id: str) -> Path:
    """The file-name prefix torch's NCCL flight recorder dumps job `job_id`'s ranks to (TORCH_FR_DUMP_TEMP_FILE):
    on the run's filesystem, so that a hang's traces outlive the node's /tmp; one folder per job, the folder
    torch's analyser reads (`torchfrtrace <folder>`). Characters other than ASCII letters, digits, `.`, `_`, `-` in
    the job id become `_`; an id of dots only (`..`) becomes `job`."""
    folder = re.sub(r"[^A-Za-z0-9._-]", "_", str(job_id)).strip(".") or "job"
    return Path(run_dir) / FLIGHT_RECORDER_DIR / folder / FLIGHT_RECORDER_FILE_PREFIX


def is_run_dir(path: Path) -> bool:
    return os.path.isfile(Path(path) / RUN_JSON)  # never raises: someone else's folder is simply not one of ours


# ---- paths this user may not read: a shared runs root holds other users' private (0700) run folders ----
def shown(text: str, limit: int = 120) -> str:
    """A path or name as an error line shows it: bytes that are not UTF-8 as \\xNN, control characters escaped,
    and a long one cut (with its length)."""
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def owner_note(path: Path) -> str:
    """` (FOLDER belongs to alice, mode 0700)` for the deepest part of `path` this user can see: what stands in the
    way of reading or writing there. Empty when nothing of it can be seen."""
    import stat

    for part in (path, *path.parents):
        try:
            st = part.stat()
        except OSError:
            continue
        owner = "you" if st.st_uid == os.geteuid() else user_name(st.st_uid)
        return f" ({shown(str(part))} belongs to {owner}, mode {stat.S_IMODE(st.st_mode):04o})"
    return ""


def user_name(uid: int) -> str:
    """The login name of `uid`; `uid N` for one the password database does not know (a container, LDAP down)."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def unreadable_error(path: Path, exc: OSError, *, where: str, what: str = "this run") -> RunDirError:
    """The one line for a run path the filesystem refused (exc): permission denied (someone else's private run: an
    UnreadableRunError), a name longer than the filesystem allows, a symbolic link loop, ..."""
    import errno

    if exc.errno in (errno.EACCES, errno.EPERM):
        return UnreadableRunError(f"cannot read {what}: {exc.strerror or 'Permission denied'}{owner_note(path)}",
                                  where=shown(where),
                                  fix="run folders are private to whoever submitted them: ask the owner, or pass "
                                      "a run of yours (`embodyhpc runs` lists them)")
    fix = "pass the folder `embodyhpc submit` printed, or the run's name as `embodyhpc runs` lists it"
    if exc.errno == errno.ENAMETOOLONG:
        return RunDirError("no such run: the path is longer than the filesystem allows (255 bytes a name)",
                           where=shown(where), fix=fix)
    if exc.errno == errno.ELOOP:
        return RunDirError("no such run: the path is a loop of symbolic links", where=shown(where), fix=fix)
    return RunDirError(f"cannot read the run folder: {exc.strerror or exc}", where=shown(where),
                       fix="check that its filesystem is mounted")


def check_readable(path: Path, *, where: str) -> None:
    """Raise unreadable_error's one line when `path` is a folder this user cannot list, or a path the filesystem
    refuses (a symbolic link loop, a name too long); a path that is not there, or a file, passes (the command says
    what is wrong with it)."""
    try:
        with os.scandir(path):
            pass
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise unreadable_error(Path(path), exc, where=where) from None


def read_report(run_dir: Path) -> dict | None:
    """report.json, or None before the report job ran; a damaged one reads as outcome "unreadable"."""
    path = Path(run_dir) / REPORT_FILE
    try:
        path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # an eval/ folder this user cannot read
        return {"outcome": "unreadable", "why": f"{path}: {exc.strerror or exc}"}
    try:
        if not path.is_file():
            raise ValueError("not a regular file")
        if path.stat().st_size > 16 << 20:
            raise ValueError("larger than 16 MiB")
        report = json.loads(path.read_bytes().decode("utf-8"))
        if not (isinstance(report, dict) and isinstance(report.get("outcome"), str)
                and isinstance(report.get("why"), str) and isinstance(report.get("headline") or {}, dict)):
            raise ValueError("not a report written by the report job")
    except (OSError, ValueError, RecursionError) as exc:
        problem = exc.strerror if isinstance(exc, OSError) else "not valid JSON" if isinstance(
            exc, (json.JSONDecodeError, UnicodeDecodeError, RecursionError)) else str(exc)
        return {"outcome": "unreadable", "why": f"{path}: {problem}"}
    return report


def read_policy_io(folder: Path) -> dict[str, Any]:
    """What the training job recorded next to the weights (POLICY_IO_FILE: the dataset's cameras, image size, state
    key, real action dims, fps); {} when there is none; a file that is not a JSON object is a one-line RunDirError
    (its fields are checked by their readers: embodyhpc.eval.policy_files)."""
    path = Path(folder) / POLICY_IO_FILE
    if not os.path.lexists(path):
        return {}
    fix = "export the checkpoint again (it copies the file training wrote), or repair it"
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise RunDirError(f"unreadable ({type(exc).__name__}: {str(exc)[:120]})", where=str(path), fix=fix) from None
    if not isinstance(data, dict):
        raise RunDirError("not a JSON object", where=str(path), fix=fix)
    return data


def new_run_dir(runs_root: str, experiment: str, name: str) -> Path:
    """A fresh, unique folder; the name sorts by creation time.

    An experiment folder made here takes the runs root's permission bits, so that on a shared runs root (group-
    writable and setgid, or world-writable and sticky) the next user's runs of that experiment go in it too. A
    folder this user may not write to is one line naming its owner (RunDirError, exit 2); nothing is created."""
    import errno

    root = Path(os.path.realpath(Path(runs_root).expanduser()))  # never raises, a symlink loop included
    parent = root / experiment
    stamp = time.strftime("%Y%m%d-%H%M%S")
    try:
        _make_experiment_dir(root, parent)
        for attempt in range(1000):
            path = parent / (f"{name}-{stamp}" if attempt == 0 else f"{name}-{stamp}-{attempt}")
            if make_run_dir(path):
                return path
    except PermissionError:
        note = owner_note(parent)
        key = "job.experiment" if note.startswith(f" ({shown(str(parent))} ") else "job.runs_root"
        raise RunDirError(f"cannot create a run folder here: permission denied{note}", where=shown(str(parent)),
                          key=key, fix=f"set another {key}, or ask the owner to let others write there (a shared "
                          "runs root: chmod 2775 with a shared group, or 1777)") from None
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP, errno.ENAMETOOLONG, errno.EROFS, errno.EEXIST):
            raise RunFailure(f"{shown(str(parent))}: cannot create a run folder: {exc.strerror or exc}") from exc
        raise RunDirError(f"cannot create a run folder here: {exc.strerror or exc}", where=shown(str(parent)),
                          key="job.runs_root", fix="set job.runs_root to a folder you can write to") from None
    raise RunDirError("could not create a unique run directory", where=str(parent))


def _make_experiment_dir(root: Path, parent: Path) -> None:
    if parent.is_dir():
        return
    for folder in (root, parent):
        if os.path.lexists(folder) and not os.path.isdir(folder):
            raise RunDirError("not a folder: a file, or a symbolic link that loops or leads nowhere",
                              where=shown(str(folder)), key="job.runs_root" if folder == root else "job.experiment",
                              fix="set job.runs_root to a folder you can write to")
    root.mkdir(parents=True, exist_ok=True)
    try:
        parent.mkdir()
    except FileExistsError:
        return  # someone else made it meanwhile: theirs, as they made it
    try:
        parent.chmod(root.stat().st_mode & 0o7777)  # as shared as the root (the umask would make it 0755)
    except OSError:
        pass  # a filesystem without chmod: the umask's bits


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
    """Write a file only its owner can read (0600): resolved configs and scripts of a run. Whole or not at all
    (replace_atomically; its temp file is 0600): a resume that dies while rewriting resolved.yaml leaves the old
    one, and a job or `eval --ckpt` reading it meanwhile never sees half of it."""
    replace_atomically(Path(path), lambda tmp: tmp.write_text(text))
