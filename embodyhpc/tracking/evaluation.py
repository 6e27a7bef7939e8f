"""What an evaluation logs to MLflow: headline numbers on the training run, everything on a child run.

    training run, at the checkpoint's step   eval/<policy>/success_rate, .../success_ci_low, .../success_ci_high
                                             (each evaluation during training adds a point: MLflow's chart of
                                             eval/trained/success_rate is the learning curve)
    child run "step <N> eval <hash>"         the same, per task too (success rate, Wilson interval, mean return,
                                             mean episode length, episodes missing), the evaluation's parameters,
                                             report.md (its images linked into the run's artifacts), plots, videos;
                                             start and end are those of the evaluation itself; FINISHED only when
                                             the evaluation is complete, FAILED with the reason otherwise

The hash (6 hex digits of the evaluation parameters) tells apart two evaluations of one checkpoint with different
settings; the step comes first because the runs table cuts long names.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

from embodyhpc.tracking.mlflow_run import (
    CLI_HTTP_ENV,
    FAILURE_TAG,
    TrackingError,
    bounded_http,
    client,
    log_child_run,
    log_step_metrics,
)
from embodyhpc.tracking.mlflow_values import one_line

STATS = {"success_rate": "success_rate", "ci_low": "success_ci_low", "ci_high": "success_ci_high",
         "mean_return": "mean_return", "mean_length": "mean_length"}
"""Aggregated statistic (embodyhpc.eval.aggregate.Stats field) -> metric name."""
HEADLINE = ("success_rate", "ci_low", "ci_high")
"""What the training run gets at each evaluated step."""
_IMAGE_LINK = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<path>[^)\s]+)\)")


def eval_params(ev: Any, *, step: int | None, weights: str | os.PathLike[str] | None,
                tasks: Sequence[str]) -> dict[str, Any]:
    """The parameters of an evaluation (`ev`: the recipe's eval section; `tasks` as the suite expands them)."""
    return {"suite": ev.suite, "tasks": list(tasks), "seeds": list(ev.seeds),
            "episodes_per_task": ev.episodes_per_task, "execute_steps": ev.execute_steps,
            "denoise_steps": ev.denoise_steps, "max_steps": ev.max_steps, "checkpoint_step": step,
            "weights": str(weights) if weights is not None else None,
            "reference_policies": list(ev.reference_policies), "suite_options": dict(ev.suite_options)}


HASHED = ("suite", "tasks", "seeds", "episodes_per_task", "execute_steps", "denoise_steps", "max_steps",
          "suite_options")
"""The settings that change the trained policy's numbers: evaluations of successive checkpoints with the same
settings share a hash (their points belong to one curve); the weights and reference rows do not count."""


def settings_hash(params: Mapping[str, Any]) -> str:
    """6 hex digits of how the policy was evaluated (HASHED)."""
    settings = {key: params.get(key) for key in HASHED}
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:6]


def child_run_name(params: Mapping[str, Any]) -> str:
    step = params.get("checkpoint_step")
    return f"step {step if step is not None else 'na'} eval {settings_hash(params)}"


def headline_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """{eval/<policy>/success_rate|success_ci_low|success_ci_high: value} of a report's results (to_dict form);
    a policy with nothing recorded has no value."""
    metrics: dict[str, float] = {}
    for name, policy in results.get("policies", {}).items():
        overall = policy["overall"]
        if overall.get("success_rate") is None:
            continue
        for field in HEADLINE:
            metrics[f"eval/{name}/{STATS[field]}"] = overall[field]
    return metrics


def child_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """Every statistic, overall and per task: eval/<policy>[/<task>]/<metric>, and episodes_missing."""
    metrics: dict[str, float] = {}
    for name, policy in results.get("policies", {}).items():
        for scope, stats in [("", policy["overall"]), *((f"/{t}", s) for t, s in policy["tasks"].items())]:
            if stats.get("success_rate") is not None:
                for field, metric in STATS.items():
                    if stats.get(field) is not None:
                        metrics[f"eval/{name}{scope}/{metric}"] = stats[field]
            metrics[f"eval/{name}{scope}/episodes_missing"] = float(stats["planned"] - stats["recorded"])
    return metrics


def mlflow_markdown(markdown: str, run_id: str, prefix: str = "") -> str:
    """report.md as MLflow's artifact viewer renders it: relative image links become the server's artifact
    download route for `run_id` (`get-artifact?path=<prefix><path>&run_uuid=...`, relative to the UI's address, as
    the UI's own image previews are); absolute URLs are left alone."""
    def link(found: re.Match[str]) -> str:
        path = found["path"]
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", path) or path.startswith(("/", "#")):
            return found[0]
        target = f"get-artifact?path={quote(prefix + path, safe='')}&run_uuid={quote(run_id, safe='')}"
        return f"![{found['alt']}]({target})"

    return _IMAGE_LINK.sub(link, markdown)


def log_evaluation(uri: str, training_run_id: str, *, step: int | None, results: Mapping[str, Any],
                   params: Mapping[str, Any], outcome: str, why: str, summary: Path | None,
                   artifacts: Sequence[tuple[Path, str | None]], start_ms: int | None, end_ms: int | None,
                   tags: Mapping[str, Any] | None = None) -> str:
    """Log one evaluation (see the module doc); returns the child run's id. The headline goes to the training run
    only for an evaluation of a checkpoint step with results."""
    headline = headline_metrics(results)
    if step is not None and headline:
        with bounded_http(CLI_HTTP_ENV):
            try:
                log_step_metrics(client(uri), training_run_id, headline, step, timestamp_ms=end_ms)
            except TrackingError:
                raise
            except Exception as exc:
                raise TrackingError(f"could not log the evaluation of step {step} on MLflow run {training_run_id}: "
                                    f"{one_line(exc)}") from exc
    complete = outcome == "complete"
    texts = None
    if summary is not None and summary.is_file():
        markdown = summary.read_text()

        def texts(run_id: str) -> dict[str, str]:
            return {summary.name: mlflow_markdown(markdown, run_id)}

    return log_child_run(uri, training_run_id, run_name=child_run_name(params), metrics=child_metrics(results),
                         step=step or 0, params=params, artifacts=artifacts, texts=texts,
                         tags={"embodyhpc.outcome": outcome, **({} if complete else {FAILURE_TAG: why}),
                               "mlflow.note.content": f"Evaluation {outcome}: {why}", **(tags or {})},
                         status="FINISHED" if complete else "FAILED", start_time_ms=start_ms, end_time_ms=end_ms)
