"""The report job: runs after training and the evaluation array, whatever their outcome.

It aggregates every shard file (success rate per task and overall with Wilson 95% intervals, per policy), and
never averages silently over fewer episodes than planned: missing shards, missing episodes and a failed training
run are recorded as such. Outputs, under eval/:

    report.json     outcome (complete | incomplete | train_failed), why, job states, the aggregated results
    report.md       the markdown summary (for terminals; also logged to MLflow); report.txt the plain table `submit`
                    prints; report.html the same with its plots embedded (MLflow's artifact viewer previews it)
    plots/          task_success.png (bars per task and policy, k/n on each), and what has something to show:
                    success_vs_step.png and task_success_vs_step.png (two evaluated steps or more), loss.png (a
                    training run's loss), contact_sheet.png (first/middle/last frame of a kept video per task and
                    outcome)
    history.jsonl   one line per report: checkpoint step, each policy's overall rate and interval and the trained
                    policy's rate per task; an evaluation
                    of a checkpoint while training ran (run.json's parent_run) writes its line into the training
                    run's history instead, so that run's success-vs-step plot holds every step evaluated

and, with tracking on (embodyhpc.tracking.evaluation): the trained policy's success rate, interval and per-task
rates on the training run at the checkpoint step with the result table in its description and the plots as images
(log_image) at that step, and a child MLflow run of it with every statistic per task, the evaluation's parameters
and times, the plots, the summaries and the rollout videos; with `tracking.backends: [mlflow, wandb]`, the same
metrics, plots and videos in the W&B run (embodyhpc.tracking.wandb_sink). An `eval --ckpt` (RunInfo.kind "eval")
logs its child run only (and a W&B run of its own, grouped with the training run's), named with its settings and
tagged with the weights it read: the training run's curve and result stay as training's own evaluations made them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from embodyhpc.atomic import write_json_atomic
from embodyhpc.checkpoint import layout
from embodyhpc.eval.shards import all_episodes
from embodyhpc.evaluate import evaluated_checkpoint
from embodyhpc.launch.eval import SHARD_STARTED_FIELD, TRAINED, plan, planned_tasks, policy_names, weights_dir
from embodyhpc.rundir import (
    ATTEMPTS_FILE,
    HISTORY_FILE,
    METRICS_FILE,
    PLOTS_DIR,
    REPORT_FILE,
    RESULT_FILE,
    SUMMARY_FILE,
    TABLE_FILE,
    VIDEOS_DIR,
    shard_file,
    shard_files,
)
from embodyhpc.runinfo import RunInfo
from embodyhpc.validation import load_resolved


def report_task(run_dir: str) -> dict:
    from embodyhpc.eval.aggregate import aggregate, format_table, load_records
    from embodyhpc.slurm.status import chain_status  # job states come from Slurm (or run.json)

    run = Path(run_dir)
    config = load_resolved(run)
    info = RunInfo.load(run)
    ev = config.eval
    shards = plan(config)
    states = {s.kind: s for s in chain_status(info) if s.kind != "report"}
    train, export = states.get("train"), states.get("export")
    trained = _trained(run, info)
    checkpoint = evaluated_checkpoint(ev)
    if checkpoint is not None:  # the export job unpins it; this is the backstop when that job never ran
        layout.unpin(checkpoint, owner=run)
    policies = policy_names(config)

    missing_shards = sorted({shard for shard in range(len(shards)) for name in policies
                             if not shard_file(run, name, shard).is_file()})
    files = shard_files(run)
    results = aggregate(load_records(files), all_episodes(planned_tasks(config), list(ev.seeds), ev.episodes_per_task),
                        policies=policies)
    step = _checkpoint_step(files)

    if "eval" not in info.jobs:  # eval.enabled: false
        why, outcome = "no evaluation (eval.enabled is false)", "complete" if trained else "train_failed"
    elif not trained:
        why = f"training did not finish (state {train.state if train else 'unknown'}"
        why += f", exit {train.exit_code})" if train and train.exit_code is not None else ")"
        outcome = "train_failed"
    elif export is not None and export.state != "COMPLETED" and missing_shards:
        why, outcome = f"the export of {checkpoint} did not complete (state {export.state})", "incomplete"
    elif missing_shards or not results.complete:
        short = {name: p.overall.planned - p.overall.recorded for name, p in results.policies.items()
                 if not p.complete}
        why = (f"{len(missing_shards)} of {len(shards)} evaluation shards missing: {missing_shards}" if missing_shards
               else f"episodes missing per policy: {short}")
        outcome = "incomplete"
    else:
        why, outcome = "all shards reported", "complete"
    report: dict[str, Any] = {
        "outcome": outcome,
        "why": why,
        "checkpoint_step": step,
        "train": {"finished": trained, "state": train.state if train else None,
                  "exit_code": train.exit_code if train else None},
        "eval": {"suite": ev.suite, "shards_planned": len(shards),
                 "shards_found": [s for s in range(len(shards)) if s not in missing_shards],
                 "shards_missing": missing_shards, "episodes_planned": sum(len(p) for p in shards),
                 "episodes_recorded": {name: p.overall.recorded for name, p in results.policies.items()},
                 "state": states["eval"].state if "eval" in states else None},
        "results": results.to_dict(),
        "headline": headline(results) if "eval" in info.jobs else {},  # no evaluation: no "n/a (0/48)" rows
    }
    outputs = _write_outputs(run, report, results, step, Path(info.parent_run or run) / HISTORY_FILE)
    print(f"report: {outcome}: {why}", flush=True)
    table = format_table(results)
    (run / TABLE_FILE).write_text(table + "\n")
    print(table, flush=True)
    if config.tracking.enabled and info.mlflow_run_id:
        report["mlflow_child_run_id"] = _log_to_mlflow(config, info, report, outputs, step, run)
    _log_to_wandb(config, info, report, outputs, step, run)
    write_json_atomic(run / REPORT_FILE, report)  # last: its presence means the report (and its MLflow run) is done
    return report


def _trained(run: Path, info: RunInfo) -> bool:
    """Training finished (an eval-only run has nothing to wait for); a result that says it failed does not count."""
    if "train" not in info.jobs:
        return True
    path = run / RESULT_FILE
    return path.is_file() and json.loads(path.read_text()).get("status", "completed") == "completed"


def headline(results: Any) -> dict[str, Any]:
    """{policy: "0.80 [0.49, 0.94] (20/20)"}: what `embodyhpc status` prints."""
    out = {}
    for name, p in results.policies.items():
        o = p.overall
        rate = "n/a" if o.success_rate is None else f"{o.success_rate:.2f} [{o.ci_low:.2f}, {o.ci_high:.2f}]"
        out[name] = f"{rate} ({o.recorded}/{o.planned} episodes)"
    return out


def _checkpoint_step(files: list[Path]) -> int | None:
    for path in files:
        if path.parent.name != TRAINED:
            continue
        for line in path.read_text().splitlines():
            if line.strip():
                step = json.loads(line).get("checkpoint_step")
                return int(step) if step is not None else None
    return None


def _write_outputs(run: Path, report: dict[str, Any], results: Any, step: int | None,
                   history: Path) -> dict[str, Path]:
    """A line in `history` (its file, or the training run's), the plots and the summaries (report.md for terminals,
    report.html with its plots embedded for MLflow's viewer); plotting problems never lose the report."""
    from embodyhpc.eval.aggregate import html_summary, markdown_summary

    trained = results.policies.get(TRAINED)
    entry = {"step": step, "outcome": report["outcome"], "run": str(run),
             **{name: [p.overall.success_rate, p.overall.ci_low, p.overall.ci_high]
                for name, p in results.policies.items()},
             "tasks": {task: stats.success_rate for task, stats in trained.tasks.items()} if trained else {}}
    history.parent.mkdir(parents=True, exist_ok=True)
    with history.open("a") as f:  # one short append per report: concurrent reports do not interleave lines
        f.write(json.dumps(entry) + "\n")
    outputs: dict[str, Path] = {}
    try:
        outputs.update(_plots(run, results, history))
    except Exception as exc:  # matplotlib missing or a plotting bug: the numbers matter more
        print(f"report: plots skipped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    captions = {name: PLOT_CAPTIONS.get(name, name) for name in outputs}
    notes = [report["why"]] + ([f"Checkpoint step {step}."] if step is not None else [])
    summary = run / SUMMARY_FILE
    links = {captions[name]: f"plots/{path.name}" for name, path in outputs.items()}
    summary.write_text(markdown_summary(results, title="Evaluation", notes=notes, images=links))
    page = run / Path(SUMMARY_FILE).with_suffix(".html")
    page.write_text(html_summary(results, title="Evaluation", notes=notes,
                                 images={captions[name]: path for name, path in outputs.items()}))
    outputs["summary"], outputs["html"] = summary, page
    return outputs


PLOT_CAPTIONS = {"task_success": "success per task (k/n episodes, Wilson 95%)",
                 "success_vs_step": "success vs training step (Wilson 95% band, reference policies as lines)",
                 "task_success_vs_step": "success per task vs training step", "loss": "training loss",
                 "contact_sheet": "rollouts: first, middle and last frame per task and outcome"}


def _plots(run: Path, results: Any, history: Path) -> dict[str, Path]:
    """Each plot that has something to show (a curve needs two evaluated steps, the loss curve a training run's
    metrics, the contact sheet kept videos)."""
    from embodyhpc.eval.plots import contact_sheet, plot_loss, plot_success_vs_step, plot_task_bars, plot_task_curves

    plots = run / PLOTS_DIR
    plots.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, Path | None] = {"task_success": plot_task_bars(results, plots / "task_success.png")}
    points, curves = [], {}
    for line in history.read_text().splitlines():
        row = json.loads(line)
        if row.get("step") is not None and row.get(TRAINED) and row[TRAINED][0] is not None:
            points.append((row["step"], *row[TRAINED]))
            for task, rate in (row.get("tasks") or {}).items():
                if rate is not None:
                    curves.setdefault(task, []).append((row["step"], rate))
    references = {name: p.overall.success_rate for name, p in results.policies.items()
                  if name != TRAINED and p.overall.success_rate is not None}
    drawn["success_vs_step"] = plot_success_vs_step(points, plots / "success_vs_step.png", references=references)
    drawn["task_success_vs_step"] = plot_task_curves(curves, plots / "task_success_vs_step.png")
    drawn["loss"] = plot_loss(_loss_points(history.parent.parent / METRICS_FILE), plots / "loss.png")
    drawn["contact_sheet"] = contact_sheet(_kept_videos(run / VIDEOS_DIR), plots / "contact_sheet.png")
    return {name: path for name, path in drawn.items() if path is not None}


def _loss_points(metrics: Path) -> list[tuple[int, float]]:
    """(step, loss) of a training run's metrics file (none for a run that did not train)."""
    points = []
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
                points.append((int(row["step"]), float(row["loss"])))
            except (ValueError, KeyError, TypeError):
                continue
    return points


def _kept_videos(videos: Path) -> dict[tuple[str, str], Path]:
    """The first kept video of each (task, outcome) of the trained policy (else of the first policy that has)."""
    if not videos.is_dir():
        return {}
    folders = sorted(videos.iterdir(), key=lambda folder: folder.name != TRAINED)
    for folder in folders:
        found: dict[tuple[str, str], Path] = {}
        for video in sorted(folder.glob("*/*.mp4")):
            outcome = video.name.split("-", 1)[0]
            if outcome in ("success", "failure"):
                found.setdefault((video.parent.name, outcome), video)
        if found:
            return found
    return {}


def _log_to_mlflow(config: Any, info: RunInfo, report: dict[str, Any], outputs: dict[str, Path],
                   step: int | None, run: Path) -> str | None:
    """The evaluation on the training run (headline at the checkpoint step) and as its child run; a tracking
    failure is reported, never fatal to the report."""
    try:
        from embodyhpc.tracking.evaluation import eval_params, log_evaluation
        from embodyhpc.tracking.mlflow_run import set_terminated, tracking_uri

        uri = tracking_uri(config.tracking, config.job.runs_root)
        artifacts = [(path, "plots" if path.suffix == ".png" else None) for name, path in outputs.items()
                     if name != "summary"]
        images = {name: path for name, path in outputs.items() if path.suffix == ".png"}
        if (run / VIDEOS_DIR).is_dir():
            artifacts.append((run / VIDEOS_DIR, "videos"))
        start_ms, end_ms = _evaluation_times(shard_files(run))
        params = eval_params(config.eval, step=step, weights=weights_dir(config, run), tasks=planned_tasks(config))
        checkpoint = evaluated_checkpoint(config.eval)
        checkpoint_tag = {"embodyhpc.checkpoint": str(checkpoint)} if checkpoint is not None else {}
        # `eval --ckpt` is a record of its own: never a point of the training run's curve nor its result
        child = log_evaluation(uri, info.mlflow_run_id, step=step, results=report["results"], params=params,
                               outcome=report["outcome"], why=report["why"], summary=outputs.get("summary"),
                               artifacts=artifacts, start_ms=start_ms, end_ms=end_ms,
                               tags={"embodyhpc.run_dir": str(run), **checkpoint_tag}, adhoc=info.kind == "eval",
                               images=images, html=outputs.get("html"))
        if report["outcome"] == "train_failed" and not info.parent_run:
            _log_failure_logs(uri, info, run)
            set_terminated(uri, info.mlflow_run_id, "FAILED", only_if_active=True, reason=report["why"])
        print(f"report: MLflow child run {child} of {info.mlflow_run_id}", flush=True)
        return child
    except Exception as exc:
        print(f"report: MLflow logging failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return None


def _log_to_wandb(config: Any, info: RunInfo, report: dict[str, Any], outputs: dict[str, Path], step: int | None,
                  run: Path) -> None:
    """With tracking.backends [mlflow, wandb]: the evaluation in the training run's W&B run (the metric names its
    MLflow run gets, against checkpoint_step), or, for `eval --ckpt`, in a W&B run of its own grouped with it."""
    from embodyhpc.tracking import wandb_sink

    if not wandb_sink.enabled(config.tracking):
        return
    try:
        from embodyhpc.tracking.evaluation import child_metrics, headline_metrics

        adhoc = info.kind == "eval"
        project = config.tracking.wandb_project or config.tracking.experiment or config.job.experiment
        if adhoc:  # its own W&B run (a new id kept in its folder), grouped under the training run's (its MLflow id)
            run_id, group = wandb_sink.wandb_run_id(run), info.mlflow_run_id
            where, metrics = run, child_metrics(report["results"])
        else:  # the training run's W&B run, whose folder keeps its id (a checkpoint's evaluation: the parent's)
            where = Path(info.parent_run or run)
            run_id, group = wandb_sink.wandb_run_id(where, info.mlflow_run_id), None
            metrics = headline_metrics(report["results"])
        videos = sorted((run / VIDEOS_DIR).glob("*/*/*.mp4")) if (run / VIDEOS_DIR).is_dir() else []
        images = {name: path for name, path in outputs.items() if path.suffix == ".png"}
        wandb_sink.log_evaluation_wandb(where, config.tracking, project=project, run_id=run_id, step=step,
                                        metrics=metrics, images=images, videos=videos, adhoc_of=group,
                                        name=f"ckpt-eval step {step}" if adhoc else None)
        sync = (f"upload: wandb sync --yes {wandb_sink.wandb_dir(where)}/offline-run-*"
                if config.tracking.wandb_mode == "offline" else "online")
        print(f"report: W&B run {run_id} ({sync})", flush=True)
    except Exception as exc:  # W&B is the second sink: its failure never costs the report
        print(f"report: W&B logging failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _log_failure_logs(uri: str, info: RunInfo, run: Path) -> None:
    """The failed training's logs on its MLflow run (logs/): what a user opens first to see why."""
    from embodyhpc.runlogs import log_files
    from embodyhpc.tracking.mlflow_run import log_artifacts

    files = [(path, "logs") for _, path in log_files(info, "train") if path.stat().st_size]
    files += [(run / name, "logs") for name in (RESULT_FILE, ATTEMPTS_FILE) if (run / name).is_file()]
    if files:
        log_artifacts(uri, info.mlflow_run_id, files)


def _evaluation_times(files: list[Path]) -> tuple[int | None, int | None]:
    """(start, end) of the evaluation in ms since the epoch: the earliest start a shard recorded, the last shard
    file written; (None, None) when no shard reported (MLflow then uses the time of logging)."""
    starts, ends = [], []
    for path in files:
        ends.append(path.stat().st_mtime)
        for line in path.read_text().splitlines():
            if line.strip():
                started = json.loads(line).get(SHARD_STARTED_FIELD)
                if isinstance(started, int | float):
                    starts.append(started)
    if not ends:
        return None, None
    end = max(ends)
    start = min(starts) if starts else min(ends)
    return int(min(start, end) * 1000), int(end * 1000)
