"""What an evaluation logs to MLflow: the curve and the result at a glance on the training run, everything on a child
run, the trained policy's numbers linked to the logged model it evaluated.

    training run, at the checkpoint's step   eval/trained/success_rate, .../success_ci_low, .../success_ci_high,
                                             eval/<task>/success_rate (one curve per task) and success_rate: each
                                             evaluation on the curve adds a point; the description's result table
                                             (trained vs references, per task, k/n and interval), the `success` tag
                                             (embodyhpc.tracking.headline). Reference policies (evaluated once) are
                                             in that table, not single-point charts.
    child run "step <N> eval <hash>"         the same, per task and per policy (success rate, Wilson interval, mean
                                             return, mean episode length, episodes missing), the evaluation's
                                             parameters, report.html (previewed by MLflow, its plots embedded),
                                             report.md (for terminals: its images are links in MLflow's viewer),
                                             plots, videos; start and end are those of the evaluation itself;
                                             FINISHED only when the evaluation is complete, FAILED with the reason
    the plots as images (log_image)          eval/<plot> at the step, on the training run for a point of its curve
                                             (the chart view shows them per step; reports/step-<N>.html there too),
                                             else on the child run
    logged model of the weights (if any)     the trained policy's metrics of the child run carry its model_id and the
                                             evaluation as their dataset: the model's page shows them

An ad-hoc evaluation (`eval --ckpt` of weights that exist: `adhoc=True`) is a record of its own: a child run named
"ckpt-eval step <N> <episodes>ep x<tasks> tasks <hash>", tagged with the weights it read, and a tag on the training
run that names it (EVAL_CKPT_TAG); it never adds a point to the training run's curve nor changes its result.

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

from embodyhpc.tracking.headline import SUCCESS_METRIC, TRAINED, success_summary, update_training_run
from embodyhpc.tracking.mlflow_run import (
    CLI_HTTP_ENV,
    FAILURE_TAG,
    MAX_METRICS_PER_BATCH,
    MAX_TAG_VALUE_LENGTH,
    TrackingError,
    bounded_http,
    client,
    log_child_run,
    log_step_metrics,
)
from embodyhpc.tracking.mlflow_values import one_line, truncate

STATS = {"success_rate": "success_rate", "ci_low": "success_ci_low", "ci_high": "success_ci_high",
         "mean_return": "mean_return", "mean_length": "mean_length"}
"""Aggregated statistic (embodyhpc.eval.aggregate.Stats field) -> metric name."""
HEADLINE = ("success_rate", "ci_low", "ci_high")
"""What the training run gets of the trained policy at each evaluated step (and each task's success_rate)."""
KIND_TAG = "embodyhpc.evaluation"
"""On an evaluation's child run: "curve" (a point of the training run's curve) or "ad-hoc" (`eval --ckpt`)."""
WEIGHTS_TAG = "embodyhpc.weights"
"""On an evaluation's child run: the checkpoint or export folder it evaluated (search_runs finds a checkpoint's)."""
EVAL_CKPT_TAG = "embodyhpc.eval_ckpt/"
"""On the training run, per ad-hoc evaluation: EVAL_CKPT_TAG + "step-<N>/<hash>" = its result, run id, weights."""
IMAGE_PREFIX = "eval/"
"""log_image key of a report plot: eval/<plot name>."""
REPORTS_DIR = "reports"
"""On the training run: reports/step-<N>.html, the rendered report of each evaluation on its curve."""
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


def adhoc_run_name(params: Mapping[str, Any]) -> str:
    """An ad-hoc evaluation's run name: what it evaluated and how much ("ckpt-eval step 400 4ep x2 tasks 3fa2c1")."""
    step = params.get("checkpoint_step")
    return (f"ckpt-eval step {step if step is not None else 'export'} {params.get('episodes_per_task')}ep "
            f"x{len(params.get('tasks') or [])} tasks {settings_hash(params)}")


def headline_metrics(results: Mapping[str, Any]) -> dict[str, float]:
    """What a point of the training run's curve holds, of a report's results (to_dict form): the trained policy's
    eval/trained/success_rate|success_ci_low|success_ci_high, eval/<task>/success_rate per task, and the short
    `success_rate`. Nothing of the reference policies, nor of what recorded nothing."""
    trained = results.get("policies", {}).get(TRAINED)
    if not trained or trained["overall"].get("success_rate") is None:
        return {}
    overall = trained["overall"]
    metrics = {f"eval/{TRAINED}/{STATS[field]}": overall[field] for field in HEADLINE}
    metrics.update({f"eval/{task}/success_rate": stats["success_rate"] for task, stats in trained["tasks"].items()
                    if stats.get("success_rate") is not None})
    metrics[SUCCESS_METRIC] = overall["success_rate"]
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
                   tags: Mapping[str, Any] | None = None, adhoc: bool = False,
                   images: Mapping[str, Path] | None = None, html: Path | None = None) -> str:
    """Log one evaluation (see the module doc); returns the child run's id. The training run's curve and result
    change only for an evaluation of a checkpoint step with results that is not ad hoc.

    `images` ({name: PNG}): logged with MLflow's log_image as eval/<name> at the step (the run page's chart view
    shows them per step), on the training run for a point of its curve, else on the child run. `html`: the
    rendered report (images embedded), also kept on the training run as reports/step-<N>.html for a curve point."""
    with bounded_http(CLI_HTTP_ENV):
        try:
            model_id = _logged_model(client(uri), training_run_id, params.get("weights"))
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"MLflow run {training_run_id} not readable in {uri}: {one_line(exc)}") from exc
    metrics = child_metrics(results)
    linked = {key: value for key, value in metrics.items()
              if model_id and key.startswith(f"eval/{TRAINED}/") and not key.endswith("/episodes_missing")}
    complete = outcome == "complete"
    texts = None
    if summary is not None and summary.is_file():
        markdown = summary.read_text()

        def texts(run_id: str) -> dict[str, str]:
            return {summary.name: mlflow_markdown(markdown, run_id)}

    weights = params.get("weights")
    child = log_child_run(uri, training_run_id, run_name=adhoc_run_name(params) if adhoc else child_run_name(params),
                          metrics={k: v for k, v in metrics.items() if k not in linked}, step=step or 0,
                          params=params, artifacts=artifacts, texts=texts,
                          tags={"embodyhpc.outcome": outcome, **({} if complete else {FAILURE_TAG: why}),
                                "mlflow.note.content": f"Evaluation {outcome}: {why}",
                                KIND_TAG: "ad-hoc" if adhoc else "curve",
                                **({WEIGHTS_TAG: str(weights)} if weights else {}), **(tags or {})},
                          status="FINISHED" if complete else "FAILED", start_time_ms=start_ms, end_time_ms=end_ms)
    headline = headline_metrics(results)
    with bounded_http(CLI_HTTP_ENV):
        try:
            mlflow_client = client(uri)
            if linked:
                _log_linked(mlflow_client, child, linked, step or 0, end_ms, model_id, params)
            if adhoc:
                label = f"step-{step if step is not None else 'export'}/{settings_hash(params)}"
                result = success_summary(results) or f"{outcome}: {why}"
                mlflow_client.set_tag(training_run_id, EVAL_CKPT_TAG + label,
                                      truncate(f"{result}; run {child}; weights {weights}", MAX_TAG_VALUE_LENGTH))
            elif step is not None and headline:
                log_step_metrics(mlflow_client, training_run_id, headline, step, timestamp_ms=end_ms)
                update_training_run(mlflow_client, training_run_id, results, step)
            on_curve = not adhoc and step is not None and bool(headline)
            log_images(mlflow_client, training_run_id if on_curve else child, images or {}, step or 0)
            if on_curve and html is not None and html.is_file():
                mlflow_client.log_text(training_run_id, html.read_text(), f"{REPORTS_DIR}/step-{step}.html")
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"could not log the evaluation of step {step} on MLflow run {training_run_id}: "
                                f"{one_line(exc)}") from exc
    return child


def log_images(mlflow_client: Any, run_id: str, images: Mapping[str, Path], step: int) -> None:
    """Each PNG as MLflow image `eval/<name>` at `step` (log_image with a key: the chart view's image panels)."""
    from PIL import Image

    for name, path in images.items():
        with Image.open(path) as opened:
            mlflow_client.log_image(run_id, opened.convert("RGB"), key=f"{IMAGE_PREFIX}{name}", step=int(step),
                                    synchronous=True)


def _logged_model(mlflow_client: Any, training_run_id: str, weights: str | None) -> str | None:
    """The training run's logged model made from the evaluated export, if any."""
    from embodyhpc.tracking.logged_model import find_logged_model

    if not weights:
        return None
    run = mlflow_client.get_run(training_run_id)
    return find_logged_model(mlflow_client, run.info.experiment_id, training_run_id, str(weights))


def _log_linked(mlflow_client: Any, run_id: str, metrics: Mapping[str, float], step: int, end_ms: int | None,
                model_id: str, params: Mapping[str, Any]) -> None:
    """`metrics` on run `run_id` linked to the logged model, the evaluation's settings as their dataset."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000) if end_ms is None else int(end_ms)
    items = [Metric(key, float(value), now, step, model_id=model_id, dataset_name=f"{params.get('suite')} eval",
                    dataset_digest=settings_hash(params)) for key, value in metrics.items()]
    for start in range(0, len(items), MAX_METRICS_PER_BATCH):
        mlflow_client.log_batch(run_id, metrics=items[start:start + MAX_METRICS_PER_BATCH], synchronous=True)
