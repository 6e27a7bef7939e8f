"""Terminal views of a run: `status` (text or JSON), the summary after a local chain, and `logs`."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

from embodyhpc.rundir import SUMMARY_FILE, TABLE_FILE, read_report, requested_evals
from embodyhpc.runinfo import RunInfo

from .table import aligned, terminal_width


def _progress_text(status) -> str:
    if status.array_size:
        counts = status.array_counts
        parts = [f"{counts.get('COMPLETED', 0)}/{status.array_size} done"]
        parts += [f"{n} {s.lower()}" for s, n in sorted(counts.items()) if s != "COMPLETED"]
        text = ", ".join(parts)
        return f"{text}; {status.reason}" if status.reason and status.state != "COMPLETED" else text
    # sacct keeps the last pending reason (e.g. Dependency) on finished jobs: show it only when useful
    return status.reason or "" if status.state != "COMPLETED" else ""


def status_report(run_dir: Path, *, as_json: bool = False, width: int | None = None, mlflow: bool = True) -> str:
    from embodyhpc.errors import RunDirError
    from embodyhpc.runstate import TRAINING_KINDS, chain_states, run_state, train_progress

    from .runs import progress_json, progress_text

    info = RunInfo.load(run_dir)
    evals, eval_infos, broken = [], [], {}
    for path in requested_evals(Path(info.run_dir)):
        try:  # a damaged evaluation folder costs its own line, not the run's status
            eval_infos.append(RunInfo.load(path))
            evals.append(path)
        except RunDirError as exc:
            broken[path.name] = exc.one_line()
    earlier = [dataclasses.replace(info, jobs=a.jobs, backend=a.backend, driver=None) for a in info.attempts]
    (statuses, *rest), from_disk = chain_states([info, *earlier, *eval_infos])  # one sacct for all
    attempt_statuses, eval_statuses = rest[:len(earlier)], rest[len(earlier):]
    report = read_report(Path(info.run_dir))
    if from_disk is not None:
        statuses = _disk_states(statuses, report)
        eval_statuses = [_disk_states(s, read_report(p)) for p, s in zip(evals, eval_statuses, strict=True)]
    note = (f"note: sacct failed ({from_disk}); the states below come from disk (run.json, report.json) and may "
            "be out of date" if from_disk is not None else None)
    state, job, _ = run_state(statuses)
    progress = train_progress(info.run_dir)
    training = any(s.kind in TRAINING_KINDS and not s.finished for s in statuses)
    if as_json:
        by_eval = {path.name: {"run_dir": str(path), "jobs": [dataclasses.asdict(s) for s in jobs],
                               "report": read_report(path)} for path, jobs in zip(evals, eval_statuses, strict=True)}
        by_eval.update({name: {"error": why} for name, why in broken.items()})
        attempts = [{**{k: v for k, v in dataclasses.asdict(a).items() if k != "jobs"},
                      "jobs": [dataclasses.asdict(s) for s in jobs]}
                     for a, jobs in zip(info.all_attempts(), [*attempt_statuses, statuses], strict=True)]
        return json.dumps({"run_dir": info.run_dir, "backend": info.backend,
                           "states_from": "slurm" if from_disk is None and info.backend == "slurm" else "disk",
                           "note": note, "state": state, "state_of": job, "progress": progress_json(progress),
                           "attempt": info.attempt, "mlflow_run_id": info.mlflow_run_id,
                           "jobs": [dataclasses.asdict(s) for s in statuses], "attempts": attempts,
                           "report": report, "evals": by_eval}, indent=2) + "\n"
    width = terminal_width() if width is None else width
    lines = [f"run {info.run_dir} ({info.backend}; {info.recipe}" + (f" + {info.site})" if info.site else ")")]
    lines += textwrap.wrap(note, width, subsequent_indent="  ") if note else []
    header = ("JOB", "ID", "STATE", "EXIT", "NODES", "PROGRESS / REASON")
    groups = list(zip(info.all_attempts(), [*attempt_statuses, statuses], strict=True))
    rows = [(s.kind, s.job_id or "-", s.state, "-" if s.exit_code is None else str(s.exit_code),
             "-" if s.nodes in (None, "", "None assigned") else s.nodes,  # sacct's words for a pending job's
             _progress_text(s)) for _, jobs in groups for s in jobs]
    head, *table = aligned(header, rows, width, squeeze=4)  # a hostlist too long is cut, never a state
    lines += head
    for attempt, jobs in groups:
        if len(groups) > 1:
            lines.append(_attempt_line(attempt))
        for _ in jobs:
            lines += table.pop(0)
    if progress is not None:
        lines.append(f"{_progress_label(statuses)}: {progress_text(progress, running=training)}")
        lines += _input_lines(progress)
    lines += _report_lines(report)
    if evals or broken:
        lines.append("evaluations while training:")
    for path, sub_statuses in zip(evals, eval_statuses, strict=True):
        jobs = ", ".join(f"{s.kind} {s.state}" + (f" ({_progress_text(s)})" if s.array_size else "")
                         for s in sub_statuses)
        lines.append(f"  {path.name}: {jobs or 'not submitted'}")
        lines += ["  " + line for line in _report_lines(read_report(path))]
    lines += [f"  {name}: {why}" for name, why in sorted(broken.items())]
    lines += _mlflow_lines(info) if mlflow else []
    return "\n".join(lines) + "\n"


def _input_lines(progress) -> list[str]:
    """Whether training waits for its data, at the last log: the step's share spent waiting, rank 0's decode time
    per sample and its loader's samples/s (runstate.TrainProgress); nothing when the metrics hold none of them."""
    from embodyhpc.runstate import INPUT_BOUND_WAIT_FRACTION

    wait, decode, rate = progress.data_wait_fraction, progress.decode_ms_per_sample, progress.loader_samples_per_s
    parts = [] if wait is None else [f"waits {100 * wait:.0f}% of each step"]
    parts += [] if decode is None else [f"decode {decode:.3g} ms/sample"]
    parts += [] if rate is None else [f"loader {rate:,.0f} samples/s"]
    if not parts:
        return []
    verdict = "" if wait is None else (": input-bound" if wait >= INPUT_BOUND_WAIT_FRACTION else ": not input-bound")
    return [f"data: {', '.join(parts)}{verdict}"]


def _progress_label(statuses: list) -> str:
    """What the progress line is about: an RL run's policy versions (its rl job), else training."""
    return "rl" if any(s.kind == "rl" for s in statuses) else "training"


def _mlflow_lines(info: RunInfo) -> list[str]:
    """Where the run's MLflow dashboards are: the one line `submit` printed (the UI address of the run's page)."""
    if not info.mlflow_run_id:
        return []
    try:
        from embodyhpc.tracking.mlflow_run import tracking_uri, ui_hint
        from embodyhpc.validation import load_resolved

        config = load_resolved(Path(info.run_dir))
        hint = ui_hint(tracking_uri(config.tracking, config.job.runs_root), info.mlflow_run_id)
    except Exception as exc:  # status answers even where the recipe or the store cannot be read
        return [f"MLflow run {info.mlflow_run_id} (no link: {' '.join(str(exc).split())[:200]})"]
    return [f"MLflow run {info.mlflow_run_id}: {hint}"]


def _attempt_line(attempt) -> str:
    """`attempt 2 (resume from step 40; slurm): resources.nodes=1`: what started it and with what."""
    how = "submit" if attempt.resumed_from_step is None else f"resume from step {attempt.resumed_from_step}"
    changes = " ".join(attempt.overrides) if attempt.resumed_from_step is not None else ""
    return " ".join(f"attempt {attempt.number} ({how}; {attempt.backend}, {attempt.created}): {changes}".split()
                    ).rstrip(":")


def _disk_states(statuses: list, report: dict | None) -> list:
    """Without sacct: what a finished report recorded (train and eval states; the report itself is done)."""
    recorded = {kind: (report.get(kind) or {}).get("state") for kind in ("train", "rl", "eval")} if report else {}
    out = []
    for s in statuses:
        state = "COMPLETED" if s.kind == "report" and report and "outcome" in report else recorded.get(s.kind)
        out.append(dataclasses.replace(s, state=state) if isinstance(state, str) and s.state == "UNKNOWN" else s)
    return out


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

    lines = [status_report(run_dir, mlflow=False).rstrip("\n")]
    table = Path(run_dir) / TABLE_FILE
    if table.is_file():
        lines += ["", table.read_text().rstrip("\n"), "", f"summary: {Path(run_dir) / SUMMARY_FILE}"]
    return "\n".join(lines + _mlflow_lines(RunInfo.load(run_dir)))


def print_logs(run_dir: Path, kind: str | None, *, follow: bool = False) -> Iterator[str]:
    from embodyhpc.runlogs import follow as follow_logs
    from embodyhpc.runlogs import log_files
    from embodyhpc.runstate import chain_states

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
        (states,), from_disk = chain_states([RunInfo.load(run_dir)])
        if from_disk is not None and info.backend == "slurm":  # no telling when the job ends: print what is there
            lost.append(from_disk)
            return True
        return all(s.finished for s in states if kind is None or s.kind == kind)

    yield from follow_logs(lambda: log_files(RunInfo.load(run_dir), kind), done)
    if lost:
        from embodyhpc.errors import SlurmError

        raise SlurmError(f"stopped following: sacct failed ({lost[0]}), so the jobs' states are unknown; "
                         f"run `embodyhpc logs {run_dir} -f` again once Slurm answers")


def watch(run_dir: Path, *, interval_s: float, live) -> int:
    """`status --watch`: one progress line (state, the job it is about, training's step, loss, throughput, ETA)
    until every job of the run has ended, then the full status. Returns the exit code: 0 when every job completed
    and the report (if any) says complete, 1 otherwise. Ctrl-C is the caller's (the run goes on)."""
    import time

    from embodyhpc.errors import FAILURE_EXIT_CODE, SUCCESS_EXIT_CODE, SlurmError
    from embodyhpc.runstate import TRAINING_KINDS, chain_states, run_state, train_progress

    from .runs import progress_text

    while True:
        info = RunInfo.load(run_dir)
        (statuses,), from_disk = chain_states([info])
        if from_disk is not None and info.backend == "slurm":
            live.close()
            raise SlurmError(f"stopped watching: sacct failed ({from_disk}), so the jobs' states are unknown; run "
                             f"`embodyhpc status {run_dir} --watch` again once Slurm answers")
        state, job, reason = run_state(statuses)
        finished = bool(statuses) and all(s.finished for s in statuses)
        progress = train_progress(info.run_dir)
        training = any(s.kind in TRAINING_KINDS and not s.finished for s in statuses)
        text = f"{state}" + (f" ({job})" if job and state != "COMPLETED" else "")
        if progress is not None:
            text += f": {progress_text(progress, running=training)}"
        elif reason and not finished:
            text += f": {reason}"
        live.show(text, force=finished)
        if finished:
            live.close()
            outcome = (read_report(Path(info.run_dir)) or {}).get("outcome", "complete")
            completed = state == "COMPLETED" and outcome == "complete"
            return SUCCESS_EXIT_CODE if completed else FAILURE_EXIT_CODE  # as `submit --local` would exit
        time.sleep(interval_s)
