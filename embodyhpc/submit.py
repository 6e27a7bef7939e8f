"""What the CLI's run commands do: create the run directory, submit (Slurm or local), report.

The backend is Slurm when a controller answers, else the local machine (with a message);
`--local` asks for the local machine explicitly.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.config.schema import JobConfig
from embodyhpc.evaluate import evaluated_checkpoint
from embodyhpc.rundir import RESOLVED_YAML, RunInfo, new_run_dir, write_private
from embodyhpc.slurm.render import chain_kinds, render_job

Progress = Callable[[str], None]


def default_run_dir(job: JobConfig) -> Path:
    """The folder `submit` would create now (render shows scripts for it)."""
    root = Path(job.runs_root).expanduser().resolve()
    return root / job.experiment / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def preflight(loaded: LoadedRecipe, python: str, *, submitting: bool, eval_only: bool = False) -> list[str]:
    """What validate, render, --dry-run and submit all check before anything exists: the paths jobs will read
    (config/paths.py) and every template of the chain (a broken or refused template fails here, as in render).
    Returns warnings; errors raise ConfigError."""
    from embodyhpc.config.paths import check_paths

    warnings = check_paths(loaded, submitting=submitting, training=not eval_only)
    for kind in chain_kinds(loaded, eval_only=eval_only):
        render_job(loaded, kind, Path("/nonexistent-run-dir"), python)
    return warnings


def dry_run(loaded: LoadedRecipe, python: str, progress: Progress = print) -> str:
    """The scripts submit would hand to sbatch, after the checks submit makes (environment, paths, templates)."""
    import os

    check_environment(loaded, dict(os.environ), progress)
    for warning in preflight(loaded, python, submitting=True):
        progress(f"warning: {warning}")
    run_dir = default_run_dir(loaded.config.job)
    kinds = chain_kinds(loaded)
    deps = {"train": "", "eval": "--dependency=afterok:<train> --kill-on-invalid-dep=yes ",
            "report": f"--dependency=afterany:<train>{':<eval>' if 'eval' in kinds else ''} "}
    out = [f"# dry run: nothing submitted; run directory would be {run_dir}"]
    for kind in kinds:
        out.append(f"# sbatch {deps[kind]}{shlex.quote(str(run_dir / 'scripts' / f'{kind}.sbatch'))}")
        out.append(render_job(loaded, kind, run_dir, python))
    return "\n".join(out)


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


def submit(loaded: LoadedRecipe, python: str, *, local: bool = False, progress: Progress = print,
           eval_only: bool = False, mlflow_parent: str | None = None) -> RunInfo:
    """Create the run directory and submit the chain (Slurm when reachable, else locally).

    eval_only: the evaluation array and the report only (`embodyhpc eval`), after an export job when eval.weights
    is a checkpoint folder; `mlflow_parent` is then the training run's MLflow run the report attaches its child
    run to.
    """
    import os

    from embodyhpc.slurm import commands

    check_environment(loaded, dict(os.environ), progress)
    for warning in preflight(loaded, python, submitting=True, eval_only=eval_only):
        progress(f"warning: {warning}")
    loaded = absolute_paths(loaded)

    backend = "local"
    if not local:
        ok, why = commands.reachable()
        if ok:
            backend = "slurm"
        else:
            progress(f"no Slurm cluster reachable ({why}): running the chain on this machine (--local)")
    job = loaded.config.job
    run_dir = new_run_dir(job.runs_root, job.experiment, job.name)
    try:
        info = start_run(loaded, run_dir, backend=backend, python=python,
                         mlflow_run_id=mlflow_parent if eval_only else _create_mlflow_run(loaded, run_dir, progress))
    except BaseException:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)  # no run folder without run.json
        raise
    progress(f"run directory: {run_dir}")
    return run_chain(loaded, info, progress=progress, eval_only=eval_only)


def submit_smoke(loaded: LoadedRecipe, python: str, *, steps: int, size: str, progress: Progress = print) -> RunInfo:
    """`embodyhpc smoke --submit`: a run directory holding the recipe and one smoke job on one node."""
    from embodyhpc.errors import UserError
    from embodyhpc.launch.smoke import REQUEST_FILE
    from embodyhpc.rundir import write_json_atomic
    from embodyhpc.slurm import commands
    from embodyhpc.slurm.chain import submit_smoke as submit_job

    ok, why = commands.reachable()
    if not ok:
        raise UserError(f"no Slurm cluster reachable ({why})", key="--submit",
                        fix="run `embodyhpc smoke` on the node itself, or submit from a login node")
    check_environment(loaded, dict(__import__("os").environ), progress)
    loaded = absolute_paths(loaded)
    render_job(loaded, "smoke", Path("/nonexistent-run-dir"), python)  # a broken template fails before anything
    job = loaded.config.job
    run_dir = new_run_dir(job.runs_root, job.experiment, f"smoke-{job.name}")
    info = start_run(loaded, run_dir, backend="slurm", python=python, mlflow_run_id=None)
    write_json_atomic(run_dir / REQUEST_FILE, {"steps": steps, "size": size})
    record = submit_job(loaded, run_dir, info)
    progress(f"submitted smoke: job {record.job_id}; run directory: {run_dir}")
    return info


def start_run(loaded: LoadedRecipe, run_dir: Path, *, backend: str, python: str, mlflow_run_id: str | None,
              parent_run: Path | None = None) -> RunInfo:
    """Fill a fresh run directory: resolved.yaml, run.json, and a pin on the checkpoint it evaluates (if any), so
    that the training run's retention keeps that checkpoint until the export job has read it."""
    write_private(run_dir / RESOLVED_YAML, loaded.to_yaml())
    info = RunInfo(run_id=run_dir.name, run_dir=str(run_dir), backend=backend, recipe=loaded.recipe,
                   site=loaded.site, overrides=list(loaded.overrides), python=python,
                   created=time.strftime("%Y-%m-%dT%H:%M:%S%z"), mlflow_run_id=mlflow_run_id,
                   parent_run=str(parent_run) if parent_run else None)
    checkpoint = evaluated_checkpoint(loaded.config.eval)
    if checkpoint is not None:
        from embodyhpc.checkpoint import layout

        layout.pin(checkpoint, owner=run_dir)
    info.save()
    return info


def run_chain(loaded: LoadedRecipe, info: RunInfo, *, progress: Progress = print, eval_only: bool = False) -> RunInfo:
    """Submit the chain of a started run to Slurm, or run it on this machine (info.backend decides)."""
    run_dir = Path(info.run_dir)
    if info.backend == "slurm":
        from embodyhpc.slurm.chain import submit_chain

        return submit_chain(loaded, run_dir, info, on_submit=lambda r: progress(
            f"submitted {r.kind}: job {r.job_id}" + (f" ({r.dependency})" if r.dependency else "")),
            eval_only=eval_only)
    from embodyhpc.slurm.local import run_local_chain

    for kind in chain_kinds(loaded, eval_only=eval_only):  # the scripts a cluster would get, for reference
        write_private(run_dir / "scripts" / f"{kind}.sbatch", render_job(loaded, kind, run_dir, info.python))
    return run_local_chain(loaded, run_dir, info, progress=progress, eval_only=eval_only)


def absolute_paths(loaded: LoadedRecipe) -> LoadedRecipe:
    """Relative data.root and eval.weights mean "from where I submit": jobs start elsewhere, so the resolved
    config every job reads holds absolute paths."""
    cfg = loaded.config
    data, ev = cfg.data, cfg.eval
    if data.root and not Path(data.root).expanduser().is_absolute():
        data = dataclasses.replace(data, root=str(Path(data.root).expanduser().resolve()))
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
    from embodyhpc.tracking.mlflow_run import TrackingError, create_run, tracking_uri, ui_hint

    uri = tracking_uri(cfg.tracking, cfg.job.runs_root)
    try:
        run_id = create_run(uri, experiment=cfg.tracking.experiment or cfg.job.experiment, run_name=run_dir.name,
                            params=_params(loaded), tags={"embodyhpc.run_dir": str(run_dir),
                                                         "embodyhpc.recipe": loaded.recipe,
                                                         "embodyhpc.site": loaded.site or ""})
    except TrackingError as exc:
        progress(f"warning: MLflow tracking off for this run: {exc}")
        return None
    progress(f"MLflow run {run_id}; dashboards: {ui_hint(uri)}")
    return run_id


def _params(loaded: LoadedRecipe) -> dict:
    import yaml

    return yaml.safe_load(loaded.to_yaml()) or {}


def _progress_text(status) -> str:
    if status.array_size:
        counts = status.array_counts
        parts = [f"{counts.get('COMPLETED', 0)}/{status.array_size} done"]
        parts += [f"{n} {s.lower()}" for s, n in sorted(counts.items()) if s != "COMPLETED"]
        text = ", ".join(parts)
        return f"{text}; {status.reason}" if status.reason and status.state != "COMPLETED" else text
    # sacct keeps the last pending reason (e.g. Dependency) on finished jobs: show it only when useful
    return status.reason or "" if status.state != "COMPLETED" else ""


def status_report(run_dir: Path, *, as_json: bool = False) -> str:
    from embodyhpc.errors import RunDirError
    from embodyhpc.launch.checkpoint_eval import requested_evals
    from embodyhpc.slurm.status import read_states

    info = RunInfo.load(run_dir)
    evals, eval_infos, broken = [], [], {}
    for path in requested_evals(Path(info.run_dir)):
        try:  # a damaged evaluation folder costs its own line, not the run's status
            eval_infos.append(RunInfo.load(path))
            evals.append(path)
        except RunDirError as exc:
            broken[path.name] = exc.one_line()
    (statuses, *eval_statuses), from_disk = read_states([info, *eval_infos])  # one sacct for all
    report = _read_report(Path(info.run_dir))
    if from_disk is not None:
        statuses = _disk_states(statuses, report)
        eval_statuses = [_disk_states(s, _read_report(p)) for p, s in zip(evals, eval_statuses, strict=True)]
    note = (f"note: sacct failed ({from_disk}); the states below come from disk (run.json, report.json) and may "
            "be out of date" if from_disk is not None else None)
    if as_json:
        by_eval = {path.name: {"run_dir": str(path), "jobs": [dataclasses.asdict(s) for s in jobs],
                               "report": _read_report(path)} for path, jobs in zip(evals, eval_statuses, strict=True)}
        by_eval.update({name: {"error": why} for name, why in broken.items()})
        return json.dumps({"run_dir": info.run_dir, "backend": info.backend,
                           "states_from": "slurm" if from_disk is None and info.backend == "slurm" else "disk",
                           "note": note, "jobs": [dataclasses.asdict(s) for s in statuses], "report": report,
                           "evals": by_eval}, indent=2) + "\n"
    lines = [f"run {info.run_dir} ({info.backend}; {info.recipe}" + (f" + {info.site})" if info.site else ")")]
    lines += [note] if note else []
    lines.append(f"{'JOB':<7} {'ID':<10} {'STATE':<11} {'EXIT':<5} {'NODES':<10} PROGRESS / REASON")
    for s in statuses:
        code = "-" if s.exit_code is None else str(s.exit_code)
        lines.append(f"{s.kind:<7} {s.job_id or '-':<10} {s.state:<11} {code:<5} {s.nodes or '-':<10} "
                     f"{_progress_text(s)}".rstrip())
    lines += _report_lines(report)
    if evals or broken:
        lines.append("evaluations while training:")
    for path, sub_statuses in zip(evals, eval_statuses, strict=True):
        jobs = ", ".join(f"{s.kind} {s.state}" + (f" ({_progress_text(s)})" if s.array_size else "")
                         for s in sub_statuses)
        lines.append(f"  {path.name}: {jobs or 'not submitted'}")
        lines += ["  " + line for line in _report_lines(_read_report(path))]
    lines += [f"  {name}: {why}" for name, why in sorted(broken.items())]
    return "\n".join(lines) + "\n"


def _disk_states(statuses: list, report: dict | None) -> list:
    """Without sacct: what a finished report recorded (train and eval states; the report itself is done)."""
    recorded = {kind: (report.get(kind) or {}).get("state") for kind in ("train", "eval")} if report else {}
    out = []
    for s in statuses:
        state = "COMPLETED" if s.kind == "report" and report and "outcome" in report else recorded.get(s.kind)
        out.append(dataclasses.replace(s, state=state) if isinstance(state, str) and s.state == "UNKNOWN" else s)
    return out


def _read_report(run_dir: Path) -> dict | None:
    """report.json, or None before the report job ran; a damaged one reads as outcome "unreadable"."""
    from embodyhpc.launch.report import REPORT_FILE

    path = Path(run_dir) / REPORT_FILE
    if not (path.exists() or path.is_symlink()):
        return None
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


def _report_lines(report: dict | None) -> list[str]:
    if not report:
        return []
    lines = [" ".join(f"report: {report['outcome']}: {report['why']}".split())]
    step = report.get("checkpoint_step")
    for policy, text in (report.get("headline") or {}).items():
        lines.append(f"  success {policy:<8} {text}" + (f" at step {step}" if policy == "trained" and step else ""))
    return lines


def local_summary(run_dir: Path) -> str:
    """After a local chain: the job states, the success table and where to look next."""
    from embodyhpc.launch.report import SUMMARY_FILE, TABLE_FILE

    lines = [status_report(run_dir).rstrip("\n")]
    table = Path(run_dir) / TABLE_FILE
    if table.is_file():
        lines += ["", table.read_text().rstrip("\n"), "", f"summary: {Path(run_dir) / SUMMARY_FILE}"]
    info = RunInfo.load(run_dir)
    if info.mlflow_run_id:
        from embodyhpc.config.load import load_resolved
        from embodyhpc.tracking.mlflow_run import tracking_uri, ui_hint

        config = load_resolved(run_dir)
        lines.append(f"MLflow run {info.mlflow_run_id}: {ui_hint(tracking_uri(config.tracking, config.job.runs_root))}")
    return "\n".join(lines)


def chain_failure(run_dir: Path) -> str | None:
    """Why a chain that ran on this machine did not complete, on one line; None when every job completed, every
    shard of an array reported and the report says complete. Evaluations run beside training count too."""
    from embodyhpc.errors import RunDirError
    from embodyhpc.launch.checkpoint_eval import requested_evals

    info = RunInfo.load(run_dir)
    problems = _chain_problems(info, _read_report(Path(info.run_dir)))
    for path in requested_evals(Path(info.run_dir)):
        try:
            sub = RunInfo.load(path)
        except RunDirError as exc:
            problems.append(f"evaluation {path.name}: {exc.one_line()}")
            continue
        problems += [f"evaluation {path.name}: {why}" for why in _chain_problems(sub, _read_report(path))]
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


def print_logs(run_dir: Path, kind: str | None, *, follow: bool = False) -> Iterator[str]:
    from embodyhpc.runlogs import follow as follow_logs
    from embodyhpc.runlogs import log_files
    from embodyhpc.slurm.status import read_states

    info = RunInfo.load(run_dir)
    if not follow:
        for label, path in log_files(info, kind):
            yield f"===== {label}: {path}"
            try:
                text = path.read_text(errors="replace")
            except OSError as exc:  # one unreadable log costs its own lines, not the others'
                yield f"(unreadable: {exc.strerror or exc})"
                continue
            yield from text.splitlines()
        return

    lost: list[str] = []  # why Slurm stopped answering, if it did

    def done() -> bool:
        (states,), from_disk = read_states([RunInfo.load(run_dir)])
        if from_disk is not None and info.backend == "slurm":  # no telling when the job ends: print what is there
            lost.append(from_disk)
            return True
        return all(s.finished for s in states if kind is None or s.kind == kind)

    yield from follow_logs(lambda: log_files(RunInfo.load(run_dir), kind), done)
    if lost:
        from embodyhpc.errors import SlurmError

        raise SlurmError(f"stopped following: sacct failed ({lost[0]}), so the jobs' states are unknown; "
                         f"run `embodyhpc logs {run_dir} -f` again once Slurm answers")


def cancel_run(run_dir: Path) -> str:
    """Cancel every job the run started: its chain, then the chains of its evaluations while training (under
    evals/, submitted from inside the training job) and their export jobs. Job ids are checked before scancel
    sees them (embodyhpc.rundir, embodyhpc.slurm.commands)."""
    from embodyhpc.errors import RunDirError
    from embodyhpc.launch.checkpoint_eval import requested_evals
    from embodyhpc.slurm.chain import cancel_chain

    info = RunInfo.load(run_dir)
    if info.backend != "slurm":
        return "local runs stop with their `embodyhpc submit` process (Ctrl-C); nothing to cancel"
    cancelled = cancel_chain(info)  # training first: it asks for no evaluation after this
    lines = [f"cancelled jobs {' '.join(cancelled) or '(none submitted)'}"]
    seen: set[Path] = set()
    damaged: list[RunDirError] = []
    for _ in range(2):  # again after the first pass: an evaluation asked for while training was being cancelled
        for path in requested_evals(Path(info.run_dir)):
            if path in seen:
                continue
            seen.add(path)
            try:
                ids = cancel_chain(RunInfo.load(path))
            except RunDirError as exc:
                damaged.append(exc)
                continue
            lines.append(f"cancelled evaluation {path.name}: jobs {' '.join(ids) or '(none submitted)'}")
    if damaged:  # what could be cancelled is; the rest needs the user (one line, exit 2)
        raise RunDirError(f"{lines[0]}; {len(damaged)} evaluation(s) not cancelled: {damaged[0].one_line()}")
    return "\n".join(lines)


def doctor_report(loaded: LoadedRecipe | None, *, as_json: bool, suggest: bool,
                  probe_bytes: int) -> tuple[str, int]:
    """Run the preflight against a recipe's expectations (or none); text and exit code."""
    from embodyhpc.hw import DoctorOptions, run_doctor, suggest_network_with_reasons

    if loaded is None:
        options, network = DoctorOptions(nvme_probe_bytes=probe_bytes), None
    else:
        cfg = loaded.config
        options = DoctorOptions(runs_root=cfg.job.runs_root, nvme_path=cfg.staging.nvme_dir,
                                nvme_probe_bytes=probe_bytes, num_nodes=cfg.resources.nodes,
                                expected_gpus=cfg.resources.gpus_per_node or None)
        network = cfg.network
    report = run_doctor(options, network=network)
    out: dict = report.to_dict()
    lines = [report.to_text().rstrip("\n")]
    if suggest:
        section, reasons = suggest_network_with_reasons(report.ib_ports)
        out["suggested_network"] = {"network": section, "why": reasons}
        import yaml

        lines += ["", "# suggested site profile section:", yaml.safe_dump({"network": section}, sort_keys=False)
                  .rstrip("\n")] + [f"#   {why}" for why in reasons]
    text = json.dumps(out, indent=2, default=str) if as_json else "\n".join(lines)
    return text + "\n", report.exit_code()
