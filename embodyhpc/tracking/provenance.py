"""Where a training run comes from, as MLflow shows it: source tags, the description, the dataset input.

- tags (MLflow's own names, so the runs table and run page show them): mlflow.user, mlflow.source.name (the
  command and recipe), mlflow.source.type JOB, mlflow.source.git.commit (the git checkout holding the recipe, else
  the one holding embodyhpc's code; absent when neither is one);
- the description (mlflow.note.content): what is trained on what, for how long, evaluated how;
- the dataset (`log_dataset`): an MLflow dataset input (context "training") named after the dataset folder, its
  source the path, its digest the fingerprint, its profile the episode and frame counts.
"""

from __future__ import annotations

import getpass
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from embodyhpc.tracking.mlflow_run import CLI_HTTP_ENV, TrackingError, bounded_http, client
from embodyhpc.tracking.mlflow_values import MAX_TAG_VALUE_LENGTH, one_line, truncate

SOURCE_TYPE = "JOB"
DATASET_CONTEXT = "training"
MAX_DIGEST_LENGTH = 36  # MLflow's limit on a dataset digest
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def git_commit(path: str | os.PathLike[str]) -> str | None:
    """HEAD of the git checkout holding `path` (a file or folder), None when it is in none (or git is missing)."""
    folder = Path(path).expanduser()
    folder = folder if folder.is_dir() else folder.parent
    if not folder.is_dir():
        return None
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) in (40, 64) else None


def source_tags(recipe: str, command: str = "embodyhpc submit") -> dict[str, str]:
    """MLflow's source tags for a run started by `command` on `recipe`."""
    tags = {"mlflow.source.name": f"{command} {recipe}", "mlflow.source.type": SOURCE_TYPE}
    try:
        tags["mlflow.user"] = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user name (a container without passwd entry): leave it out
        pass
    commit = git_commit(recipe) or git_commit(_PACKAGE_DIR)
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


def describe(config: Any, recipe: str, overrides: Sequence[str]) -> str:
    """The run's description (markdown, one paragraph per fact)."""
    model, data, train, res, ev = config.model, config.data, config.train, config.resources, config.eval
    source = f"`{data.root}`" if data.root else "a mixture of " + ", ".join(  # data.datasets
        f"`{entry.root}` (weight {entry.weight:g})" for entry in getattr(data, "datasets", None) or ())
    what = (f"**{model.name} ({model.size})** trained on {source} ({data.format})"
            if data.format != "synthetic" else "the synthetic stand-in (no policy)")
    lines = [f"{what} for {train.steps} steps, global batch {train.global_batch_size}, on {res.nodes} node(s) x "
             f"{res.tasks_per_node} task(s), {res.gpus_per_node} GPU(s) per node."]
    if ev.enabled:
        when = (f"every {ev.every_k_checkpoints * config.checkpoint.every_steps} steps and at the end"
                if ev.every_k_checkpoints else "at the end")
        lines.append(f"Evaluated {when} on {ev.suite} ({', '.join(ev.tasks)}), seeds {list(ev.seeds)}, "
                     f"{ev.episodes_per_task} episodes per task and seed.")
    lines.append(f"Recipe `{recipe}`" + (f", overrides `{' '.join(overrides)}`" if overrides else ", no overrides")
                 + ".")
    return truncate("\n\n".join(lines), MAX_TAG_VALUE_LENGTH)


def log_dataset(uri: str, run_id: str, *, name: str, path: str, num_episodes: int | None,
                fingerprint: str, profile: Mapping[str, Any] | None = None) -> None:
    """The training dataset as the run's input (MLflow's Datasets column and run page)."""
    from mlflow.entities import Dataset, DatasetInput, InputTag

    stats = {"num_episodes": num_episodes, "fingerprint": fingerprint, **(profile or {})}
    dataset = Dataset(name=name, digest=fingerprint[:MAX_DIGEST_LENGTH], source_type="local",
                      source=json.dumps({"uri": str(path)}), profile=json.dumps(stats, default=str))
    with bounded_http(CLI_HTTP_ENV):
        try:
            client(uri).log_inputs(run_id, datasets=[DatasetInput(
                dataset, tags=[InputTag("mlflow.data.context", DATASET_CONTEXT)])])
        except Exception as exc:
            raise TrackingError(f"could not log the dataset input of MLflow run {run_id}: {one_line(exc)}") from exc
