"""What the CLI's run commands do: create the run directory, submit (Slurm or local), report.

The backend is Slurm when a controller answers, else the local machine (with a message);
`--local` asks for the local machine explicitly.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from embodyhpc.atomic import write_json_atomic
from embodyhpc.rundir import SMOKE_REQUEST_FILE, new_run_dir, read_report, requested_evals
from embodyhpc.runinfo import RunInfo

if TYPE_CHECKING:
    from embodyhpc.config.load import LoadedRecipe
    from embodyhpc.config.schema import JobConfig
    from embodyhpc.orchestrate.api import DryRun
    from embodyhpc.orchestrate.plan import Plan
    from embodyhpc.runstate import TrainProgress

# the chain's machinery (config loading, Jinja, orchestration) is imported where a run is started, not here:
# status, logs, runs and cancel import this module and stay quick
Progress = Callable[[str], None]


def default_run_dir(job: JobConfig) -> Path:
    """The folder `submit` would create now (render shows scripts for it)."""
    import os

    root = Path(os.path.realpath(Path(job.runs_root).expanduser()))  # not resolve(): that raises on a link loop
    return root / job.experiment / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def runs_root(site: str | None = None, explicit: str | Path | None = None) -> Path:
    """Where run names, `latest` and `embodyhpc runs` look: `explicit` (--runs-root), else the site profile's
    job.runs_root (--site or $EMBODYHPC_SITE), else the schema's default (./runs)."""
    import os

    from embodyhpc.config.load import site_runs_root

    chosen = Path(explicit if explicit is not None else site_runs_root(site)).expanduser()
    return Path(os.path.realpath(chosen))  # not Path.resolve(): that raises on a symlink loop


def find_run_dir(ref: str | Path, *, site: str | None = None, root: str | Path | None = None) -> Path:
    """The run folder a RUN argument names: an existing folder, a run name or `latest` (find_run) under
    runs_root(site, root). Every command that takes a run folder resolves it here. An existing folder is used as
    it is, without reading the site profile. A folder this user may not read (someone else's private run on a
    shared runs root), a path longer than the filesystem allows or a symbolic link loop is one line (exit 2)."""
    text = str(ref)
    if _names_a_path(text):
        return check_run_path(text)
    found = find_run(ref, runs_root(site, root))
    check_run_path(str(found), where=text)
    return found


def check_run_path(text: str, *, where: str | None = None) -> Path:
    """The path a RUN (or a run's export) argument gives, once it is known to be usable: longer than the filesystem
    allows, a symbolic link loop or a folder this user may not read (someone else's private run) is one line
    (RunDirError, exit 2). A path that is not there passes: the command says what it expected."""
    from embodyhpc.rundir import check_readable

    _check_length(text)
    path = Path(text).expanduser()
    check_readable(path, where=text if where is None else where)
    return path


def find_run(ref: str | Path, runs_root: str | Path) -> Path:
    """The run folder a RUN argument means: a folder that exists (as always), `latest` (your newest run under the
    runs root: on a shared root, not another user's), a run's folder name (`demo-metaworld-20261125-170000`), a
    unique start of one (`demo-metaworld` when only one run starts so), or `EXPERIMENT/NAME` relative to the runs
    root.

    An unknown or ambiguous name is a one-line RunDirError (exit 2) listing the nearest runs. Text with a '/' that
    names no run is returned as the path it is (RunInfo.load then says it holds no run.json); other text that is no
    plain name (a glob or control character, a leading '.') is refused. Names are compared as text: nothing is
    globbed, and only folders inside the runs root (runstate.scan_runs) are candidates: the runs this user can
    read first, then the folders of runs they cannot (whose name then gets a one line saying so)."""
    from embodyhpc.errors import RunDirError
    from embodyhpc.rundir import shown
    from embodyhpc.runstate import LATEST, owned, run_label, scan_runs

    text = str(ref)
    path = Path(text).expanduser()
    if _names_a_path(text):  # refuses a name longer than the filesystem allows
        return path
    found = scan_runs(runs_root)
    root, runs = found.root, found.runs
    where = f"RUN '{shown(text)}'"
    if text == LATEST:  # your newest training run; your newest evaluation (`eval --ckpt`) only if that is all
        mine = [run for run in runs if owned(run)]
        if mine:
            return next((run for run in mine if not _is_evaluation(run)), mine[0])
        others = f" yet ({len(runs)} of other users)" if runs else " yet"
        raise RunDirError(f"there is no run {'of yours ' if runs else ''}under {root}{others}", where=where,
                          fix="submit one, or point --runs-root (or --site) at the runs root that holds yours")
    closed = [run for run in found.unreadable if run.parent != root]  # run folders of others, by name only
    named = {run_label(run, root): run for run in [*closed, *runs]}
    if text in named:  # EXPERIMENT/NAME
        return named[text]
    if "/" in text:  # a path after all: RunInfo.load says what is wrong with it
        return path
    if not _PLAIN_NAME_RE.match(text):
        raise RunDirError("no such run folder, and not a run name (letters, digits, '.', '_', '+', '-')",
                          where=where, fix=f"pass a run folder, a name `embodyhpc runs` lists, or {LATEST}")
    for candidates in (runs, closed):
        matches = ([run for run in candidates if run.name == text]
                   or [run for run in candidates if run.name.startswith(text)])
        if len(matches) == 1:
            return matches[0]
        if matches:
            listed = ", ".join(run_label(run, root) for run in matches[:5]) + (", ..." if len(matches) > 5 else "")
            raise RunDirError(f"{len(matches)} runs under {root} match: {listed}", where=where,
                              fix="use more of the name, EXPERIMENT/NAME, or the run folder")
    import difflib

    label_of = {run.name: run_label(run, root) for run in reversed(runs)}  # the newest run of a name wins
    nearest = [label_of[name] for name in difflib.get_close_matches(text, list(label_of), n=3, cutoff=0.5)]
    if not nearest and runs:
        nearest = [run_label(run, root) for run in runs[:3]]  # the newest, as a hint of what exists
    hint = f"nearest: {', '.join(nearest)}" if nearest else "the runs root holds no runs"
    unsearched = len(found.unreadable) - len(closed)
    if unsearched:
        hint += f"; {unsearched} folder{'s' if unsearched > 1 else ''} there you cannot read not searched"
    raise RunDirError(f"no run of that name under {root} ({hint})", where=where,
                      fix="`embodyhpc runs` lists them; --runs-root (or --site) picks another runs root")


def _is_evaluation(run: Path) -> bool:
    """Whether a run folder holds an evaluation of existing weights (RunInfo.kind); an unreadable run.json counts
    as training (`latest` may then name it, and the command says what is wrong)."""
    from embodyhpc.runinfo import RunInfo

    try:
        return RunInfo.load(run).kind != "train"
    except Exception:  # noqa: BLE001 - a damaged run.json is reported by the command that reads it
        return False


_PLAIN_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]*$")


def _names_a_path(text: str) -> bool:
    """Whether a RUN argument is a path that is there (even one this user may not read, or a symbolic link loop).
    Path.exists() would raise for those, and for a name longer than the filesystem allows (_check_length)."""
    import os

    if not text:
        return False
    _check_length(text)
    try:
        os.stat(Path(text).expanduser())
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL byte
        return False
    except OSError:
        return True  # there, and check_readable (or RunInfo.load) says why it cannot be read
    return True


NAME_MAX_BYTES = 255
PATH_MAX_BYTES = 4095
"""Linux's limits (and those of the filesystems runs live on): a longer RUN argument names nothing."""


def _check_length(text: str) -> None:
    import os

    from embodyhpc.errors import RunDirError
    from embodyhpc.rundir import shown

    longest = max((len(os.fsencode(part)) for part in text.split("/")), default=0)
    if longest <= NAME_MAX_BYTES and len(os.fsencode(text)) <= PATH_MAX_BYTES:
        return
    problem = (f"{longest} bytes in one name, more than a filesystem allows ({NAME_MAX_BYTES})"
               if longest > NAME_MAX_BYTES else f"a path of more than {PATH_MAX_BYTES} bytes")
    raise RunDirError(f"no such run: {problem}", where=f"RUN '{shown(text)}'",
                      fix="pass the folder `embodyhpc submit` printed, or a name `embodyhpc runs` lists")


PLACEHOLDER_RUN_DIR = Path("/nonexistent-run-dir")
"""The run folder `validate` renders for: the scripts are checked, not shown."""


def preflight(loaded: LoadedRecipe, python: str, *, submitting: bool, eval_only: bool = False) -> list[str]:
    """What validate, render, --dry-run, submit and resume all check before anything exists: the paths jobs will read
    (validation/paths.py). Returns warnings; errors raise ConfigError. The templates are checked where the plan is made
    (orchestrate.plan renders every job once, before a run folder is filled)."""
    from embodyhpc.validation.paths import check_paths

    return check_paths(loaded, submitting=submitting, training=not eval_only)


def validate(loaded: LoadedRecipe, python: str) -> list[str]:
    """`embodyhpc validate`: the preflight and every template of the chain (rendered for a placeholder folder)."""
    from embodyhpc.orchestrate.plan import chain_plan

    warnings = preflight(loaded, python, submitting=False)
    chain_plan(loaded, PLACEHOLDER_RUN_DIR, python)
    return warnings


def render(loaded: LoadedRecipe, python: str, run_dir: Path, kind: str | None = None,
           progress: Progress = print) -> Plan:
    """`embodyhpc render`: the chain's plan for `run_dir` (or one job of `kind` alone), after the preflight; its
    scripts are what submit hands to sbatch."""
    from embodyhpc.orchestrate.plan import chain_plan, kind_plan

    for warning in preflight(loaded, python, submitting=False):
        progress(f"warning: {warning}")
    return kind_plan(loaded, kind, run_dir, python) if kind else chain_plan(loaded, run_dir, python)


def dry_run(loaded: LoadedRecipe, python: str, progress: Progress = print) -> DryRun:
    """The scripts submit would hand to sbatch, after the checks submit makes (environment, paths, templates)."""
    import os

    from embodyhpc.orchestrate.api import dry_run as preview
    from embodyhpc.orchestrate.plan import chain_plan

    check_environment(loaded, dict(os.environ), progress)
    for warning in preflight(loaded, python, submitting=True):
        progress(f"warning: {warning}")
    return preview(chain_plan(loaded, default_run_dir(loaded.config.job), python))


def check_environment(loaded: LoadedRecipe, environ: dict[str, str], progress: Progress) -> None:
    """Jobs inherit the submitting shell's environment, then the script exports the network profile.
    A variable the user set to something else would be silently overridden: refuse, say how to fix.
    Variables the profile does not set are inherited as they are: say so."""
    from embodyhpc.config import nccl_values
    from embodyhpc.errors import ConfigError
    from embodyhpc.hw.versions import exported_nccl_env

    network = loaded.config.network
    clashes = network.conflicts(environ)
    if clashes:
        name, (mine, theirs) = next(iter(clashes.items()))
        others = f" (also: {', '.join(list(clashes)[1:])})" if len(clashes) > 1 else ""
        raise ConfigError(f"your environment sets {name}={mine!r} but the network profile sets {theirs!r}{others}",
                          where=loaded.provenance.get("network.fabric", "network profile"), key="network",
                          fix=f"unset {name}, or set network.extra_env.{name}={mine} to make it the profile's value")
    inherited = {k: v for k, v in exported_nccl_env(environ).items() if k not in network.environment()}
    for name, value in inherited.items():  # the job runs with these: the same ranges as the profile's own
        try:
            nccl_values.check_value(name, value, f"network.extra_env.{name}")
        except ConfigError as exc:
            raise ConfigError(exc.message, where="your environment", key=name,
                              fix=f"unset {name}, or {exc.fix}") from None
    if inherited:
        progress("note: jobs inherit from your environment " + ", ".join(f"{k}={v}" for k, v in inherited.items()))
    unset = [name for name in loaded.config.site.secrets if not environ.get(name)]
    if unset:
        progress(f"warning: site.secrets names {', '.join(unset)}, not set in your environment: jobs will not "
                 "have " + ("it" if len(unset) == 1 else "them"))


def prepare_launch(loaded: LoadedRecipe, python: str, *, local: bool, progress: Progress = print,
                   eval_only: bool = False, warnings: Sequence[str] = ()) -> tuple[LoadedRecipe, str]:
    """What `submit` and `resume` do before a chain starts: check the environment, print the preflight's warnings
    (after `warnings`), make the recipe's paths absolute and choose the backend (Slurm when reachable, else this
    machine). Returns the recipe to run and the backend."""
    import os

    from embodyhpc.slurm import commands

    check_environment(loaded, dict(os.environ), progress)
    for warning in [*warnings, *preflight(loaded, python, submitting=True, eval_only=eval_only)]:
        progress(f"warning: {warning}")
    loaded = absolute_paths(loaded)
    if local:
        return loaded, "local"
    ok, why = commands.reachable()
    if not ok:
        progress(f"no Slurm cluster reachable ({why}): running the chain on this machine (--local)")
        return loaded, "local"
    return loaded, "slurm"


def submit(loaded: LoadedRecipe, python: str, *, local: bool = False, progress: Progress = print,
           eval_only: bool = False, mlflow_parent: str | None = None,
           on_train_progress: Callable[[TrainProgress], None] | None = None) -> RunInfo:
    """Create the run directory and submit the chain (Slurm when reachable, else locally).

    eval_only: the evaluation array and the report only (`embodyhpc eval`), after an export job when eval.weights
    is a checkpoint folder; `mlflow_parent` is then the training run's MLflow run the report attaches its child
    run to. on_train_progress: a chain that runs here calls it from a thread of its own whenever training logged
    a new step (runlogs.read_last_metrics), until the chain ends.
    """
    from embodyhpc.orchestrate.api import run_chain, start_run
    from embodyhpc.orchestrate.plan import chain_plan
    from embodyhpc.runlock import run_lock

    loaded, backend = prepare_launch(loaded, python, local=local, progress=progress, eval_only=eval_only)
    job = loaded.config.job
    run_dir = new_run_dir(job.runs_root, job.experiment, job.name)
    # held while the folder is filled and the chain submitted (a chain run here: shared until it ends), so that a
    # `resume latest` or `cancel latest` meanwhile is refused naming this command (embodyhpc.runlock)
    with run_lock(run_dir, "embodyhpc eval" if eval_only else "embodyhpc submit", progress=progress) as lock:
        try:
            plan = chain_plan(loaded, run_dir, python, eval_only=eval_only)  # a broken template fails here
            info = start_run(loaded, run_dir, backend=backend, python=python, mlflow_run_id=mlflow_parent
                             if eval_only else _create_mlflow_run(loaded, run_dir, progress))
        except BaseException:
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)  # no run folder without run.json
            raise
        progress(f"run directory: {run_dir}")
        if backend == "local":
            lock.share()
        if backend != "local" or on_train_progress is None or eval_only:
            return run_chain(loaded, info, progress=progress, eval_only=eval_only, plan=plan)
        with _ProgressPoller(run_dir, on_train_progress):
            return run_chain(loaded, info, progress=progress, eval_only=eval_only, plan=plan)


class ChangePoller:
    """From a daemon thread, every `poll_s`: `report(value)` each time `look()` returns a value that is not None and
    whose `key(value)` differs from the last one reported (default: the value itself). A `look` or `report` that
    raises ends the polling (a display that failed must not touch the chain; a `look` may raise to say there is
    nothing to follow). A context manager: polls while the `with` body runs. submit --local's training progress
    (_ProgressPoller) and `eval --ckpt`'s episode count (cli/eval_view.py) are the two."""

    def __init__(self, look: Callable[[], object], report: Callable[[object], None], *, poll_s: float, name: str,
                 key: Callable[[object], object] = lambda value: value) -> None:
        import threading

        self.look, self.report, self.poll_s, self.key = look, report, poll_s, key
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._poll, name=name, daemon=True)

    def __enter__(self) -> ChangePoller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def _poll(self) -> None:
        last = None
        while not self.stop.wait(self.poll_s):
            try:
                found = self.look()
                if found is not None and self.key(found) != last:
                    last = self.key(found)
                    self.report(found)
            except Exception:  # noqa: BLE001 - a display that failed must not touch the chain
                return


class _ProgressPoller(ChangePoller):
    """Calls `report` with training's progress each time the metrics file has a new step."""

    POLL_S = 1.0

    def __init__(self, run_dir: Path, report: Callable[[TrainProgress], None]) -> None:
        from embodyhpc import runstate

        self.run_dir = run_dir
        super().__init__(lambda: runstate.train_progress(run_dir), report, poll_s=self.POLL_S,
                         name="train-progress", key=lambda progress: progress.step)


def submit_smoke(loaded: LoadedRecipe, python: str, *, model: str, steps: int, size: str,
                 progress: Progress = print) -> RunInfo:
    """`embodyhpc smoke --submit`: a run directory holding the recipe and one smoke job on one node, which smokes
    `model` (the recipe's model.name) at `size` (smoke-request.json says both)."""
    from embodyhpc.errors import UserError
    from embodyhpc.orchestrate.api import start_run
    from embodyhpc.orchestrate.api import submit_smoke as submit_job
    from embodyhpc.orchestrate.plan import smoke_plan
    from embodyhpc.slurm import commands

    ok, why = commands.reachable()
    if not ok:
        raise UserError(f"no Slurm cluster reachable ({why})", key="--submit",
                        fix="run `embodyhpc smoke` on the node itself, or submit from a login node")
    check_environment(loaded, dict(__import__("os").environ), progress)
    loaded = absolute_paths(loaded)
    job = loaded.config.job
    run_dir = new_run_dir(job.runs_root, job.experiment, f"smoke-{job.name}")
    try:
        plan = smoke_plan(loaded, run_dir, python)  # a broken template fails before anything is submitted
    except BaseException:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    info = start_run(loaded, run_dir, backend="slurm", python=python, mlflow_run_id=None)
    write_json_atomic(run_dir / SMOKE_REQUEST_FILE, {"model": model, "steps": steps, "size": size})
    record = submit_job(plan, info)
    progress(f"submitted smoke: job {record.job_id}; run directory: {run_dir}")
    return info


def absolute_paths(loaded: LoadedRecipe) -> LoadedRecipe:
    """Relative data.root, data.datasets[i].root and eval.weights mean "from where I submit": jobs start
    elsewhere, so the resolved config every job reads holds absolute paths."""
    cfg = loaded.config
    data, ev = cfg.data, cfg.eval
    if data.root and not Path(data.root).expanduser().is_absolute():
        data = dataclasses.replace(data, root=str(Path(data.root).expanduser().resolve()))
    if data.datasets and any(not Path(e.root).expanduser().is_absolute() for e in data.datasets):
        data = dataclasses.replace(data, datasets=[dataclasses.replace(e, root=str(Path(e.root).expanduser().resolve()))
                                                   for e in data.datasets])
    if ev.weights and not Path(ev.weights).expanduser().is_absolute():
        ev = dataclasses.replace(ev, weights=str(Path(ev.weights).expanduser().resolve()))
    if data is cfg.data and ev is cfg.eval:
        return loaded
    return dataclasses.replace(loaded, config=dataclasses.replace(cfg, data=data, eval=ev))


def _create_mlflow_run(loaded: LoadedRecipe, run_dir: Path, progress: Progress) -> str | None:
    """The training run's MLflow run, created now (status SCHEDULED) so that every job of the chain finds it in
    run.json. The store is initialised here, once, before jobs fan out (concurrent first use of a sqlite store
    fails). A store that cannot be reached costs the dashboards, not the run: a warning, and tracking is off."""
    cfg = loaded.config
    if not cfg.tracking.enabled:
        return None
    import yaml

    from embodyhpc.tracking.mlflow_run import TrackingError, create_run, run_display_name, tracking_uri, ui_hint
    from embodyhpc.tracking.mlflow_values import redact, redact_override
    from embodyhpc.tracking.provenance import describe, source_tags

    overrides = [redact_override(o) for o in loaded.overrides]
    uri = tracking_uri(cfg.tracking, cfg.job.runs_root)
    try:
        run_id = create_run(uri, experiment=cfg.tracking.experiment or cfg.job.experiment,
                            run_name=run_display_name(run_dir.name, cfg.job.name), params=_params(loaded),
                            tags={"embodyhpc.run_dir": str(run_dir), "embodyhpc.recipe": loaded.recipe,
                                  "embodyhpc.site": loaded.site or "", **source_tags(loaded.recipe)},
                            description=describe(cfg, loaded.recipe, overrides),
                            texts={"recipe/resolved.yaml": yaml.safe_dump(redact(_params(loaded)), sort_keys=False),
                                   "recipe/overrides.txt": "".join(f"{o}\n" for o in overrides)})
    except TrackingError as exc:
        progress(f"warning: MLflow tracking off for this run: {exc}")
        return None
    progress(f"MLflow run {run_id}; dashboards: {ui_hint(uri, run_id)}")
    return run_id


def _params(loaded: LoadedRecipe) -> dict:
    import yaml

    return yaml.safe_load(loaded.to_yaml()) or {}


def chain_failure(run_dir: Path) -> str | None:
    """Why a chain that ran on this machine did not complete, on one line; None when every job completed, every
    shard of an array reported and the report says complete. Evaluations run beside training count too."""
    from embodyhpc.errors import RunDirError

    info = RunInfo.load(run_dir)
    problems = _chain_problems(info, read_report(Path(info.run_dir)))
    for path in requested_evals(Path(info.run_dir)):
        try:
            sub = RunInfo.load(path)
        except RunDirError as exc:
            problems.append(f"evaluation {path.name}: {exc.one_line()}")
            continue
        problems += [f"evaluation {path.name}: {why}" for why in _chain_problems(sub, read_report(path))]
    return " ".join(("the chain did not complete: " + "; ".join(problems)).split()) if problems else None


def _chain_problems(info: RunInfo, report: dict | None) -> list[str]:
    problems = []
    for record in info.jobs.values():
        why = []
        if record.state != "COMPLETED":
            why.append(f"{record.state or 'never ran'}" + (f" ({record.reason})" if record.reason else ""))
        done = record.array_counts.get("COMPLETED", 0)
        if record.array_size and done < record.array_size:
            why.append(f"{done} of {record.array_size} shards completed")
        if why:
            problems.append(f"{record.kind} " + ", ".join(why))
    if "report" in info.jobs:
        if report is None:
            problems.append("no report.json")
        elif report.get("outcome") != "complete":
            problems.append(f"report {report.get('outcome')}: {report.get('why')}")
    return problems
