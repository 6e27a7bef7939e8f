"""`embodyhpc eval --ckpt PATH`: the evaluation array and report for weights that already exist.

PATH may be
- an export folder (model.safetensors + config.yaml + export.json; what every training run writes to export/),
- a checkpoint folder `checkpoints/step-N` of a run (complete: it has the .complete marker); the chain then starts
  with an export job (embodyhpc.launch.export) that writes the run's exports/step-N/ once (with the run's
  normalisation files), and that folder is evaluated; the checkpoint is pinned until then, so the training run's
  retention cannot delete it while the job waits in the queue,
- a run directory (its export/ is evaluated).
The recipe is the one the weights were trained with (config.yaml / resolved.yaml), then `key=value` overrides
and --suite; eval.weights points at the weights. When the weights belong to a run with an MLflow run in its
run.json, the report logs its child run there, next to the run's own evaluations.

Before anything is created (`check_inputs`, after the recipe is loaded), everything this machine can check is:
the export's weights, config and side files against export.json's hashes (checkpoint/integrity.py); the side files'
contents against the weights' recipe and the evaluation's suite (eval/policy_files.py); eval.weights naming what
--ckpt names; no model.* override (the shards build the model from the weights' own recipe, so one would be ignored);
eval.weights_kind against what PATH holds (`check_weights_kind`: a checkpoint's marker says whether it saved a moving
average of the weights, an export's export.json which weights it holds).
A mistake is one line naming the file or key and the fix (exit 2), and no run folder exists.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from embodyhpc.checkpoint import layout
from embodyhpc.checkpoint.integrity import CONFIG_FILE, DCP_METADATA, EXPORT_JSON, WEIGHTS_FILE, verify_export
from embodyhpc.config.schema import Config, EvalConfig
from embodyhpc.errors import UserError
from embodyhpc.rundir import CHECKPOINTS_DIR, EXPORT_DIR, EXPORTS_DIR, RESOLVED_YAML, RUN_JSON
from embodyhpc.runinfo import RunInfo

EXPORT_FILES = (EXPORT_JSON, CONFIG_FILE, WEIGHTS_FILE)
SIDE_FILE_DIRS = (CHECKPOINTS_DIR, EXPORT_DIR)
"""Where a training run keeps the side files of its checkpoints (eval/policy_files.py): the first found wins (runs
from before they were written next to the checkpoints have them in export/ only)."""


@dataclass(frozen=True)
class EvalSource:
    config_path: Path
    """The recipe the weights were trained with."""
    weights: Path | None
    """An export folder to evaluate as it is; None when `checkpoint` must be exported first (by the export job)."""
    checkpoint: Path | None
    source_run: Path | None
    """The training run directory, when PATH lies in one."""
    mlflow_parent: str | None


def resolve_source(path: Path) -> EvalSource:
    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise UserError("does not exist", key="--ckpt", where=str(path),
                        fix="pass an export folder, a checkpoints/step-N folder or a run directory")
    if (path / RUN_JSON).is_file():  # a run directory: its export
        if not (path / EXPORT_DIR).exists():
            raise UserError(f"the run has no {EXPORT_DIR}/ (training has not finished, or did not export)",
                            key="--ckpt", where=str(path), fix=_checkpoint_hint(path))
        return resolve_source(path / EXPORT_DIR)
    if any((path / name).is_file() for name in EXPORT_FILES):  # an export, whole or not: verify says what is wrong
        verify_export(path)  # weights, config and side files against export.json: one line (exit 2) when they differ
        if not (path / CONFIG_FILE).is_file():  # an export.json from before config.yaml was hashed
            raise UserError(f"{CONFIG_FILE} is missing: the recipe the weights were trained with", key="--ckpt",
                            where=str(path), fix="export the checkpoint again")
        run = path.parent if (path.parent / RUN_JSON).is_file() else None
        return EvalSource(path / CONFIG_FILE, path, None, run, _mlflow_run(run))
    if layout.is_complete(path):
        run = path.parent.parent
        if path.parent.name != CHECKPOINTS_DIR or not (run / RESOLVED_YAML).is_file():
            why = (f"no {run / RESOLVED_YAML}" if path.parent.name == CHECKPOINTS_DIR
                   else f"it is not in a {CHECKPOINTS_DIR}/ folder")
            raise UserError(f"a checkpoint outside a run directory ({why})", key="--ckpt", where=str(path),
                            fix="pass the run's export/ folder, or a step-N folder inside a run")
        metadata = path / DCP_METADATA
        if not metadata.is_file() or metadata.stat().st_size == 0:
            raise UserError(f"a damaged checkpoint ({DCP_METADATA} is missing or empty)", key="--ckpt",
                            where=str(path), fix="evaluate another step-N folder or the run's export/")
        return EvalSource(run / RESOLVED_YAML, None, path, run, _mlflow_run(run))
    if path.name.startswith("step-"):
        raise UserError("an incomplete checkpoint (no .complete marker: the save did not finish)", key="--ckpt",
                        where=str(path), fix="evaluate the previous step-N folder or the run's export/")
    raise UserError("neither an export folder, a checkpoint step-N folder nor a run directory", key="--ckpt",
                    where=str(path), fix="pass e.g. RUN_DIR/export or RUN_DIR/checkpoints/step-1000")


def _checkpoint_hint(run: Path) -> str:
    newest = layout.list_steps(run / CHECKPOINTS_DIR).newest_complete
    if newest is None:
        return "wait for training to save a checkpoint, then pass RUN/checkpoints/step-N"
    return f"evaluate its newest complete checkpoint: --ckpt {layout.step_dir(run / CHECKPOINTS_DIR, newest)}"


def check_inputs(source: EvalSource, config: Config) -> None:
    """Everything about an evaluation of `source` with `config` (the loaded recipe: the weights' own, overrides and
    --suite applied) that this machine can check before anything is created (module doc); UserError otherwise."""
    from dataclasses import fields

    from embodyhpc.eval.policy_files import check_policy_files, check_suite, find_side_files
    from embodyhpc.validation import load_config_file

    weights = source.weights or source.checkpoint
    named = config.eval.weights
    if not named or _resolved(named) != weights:
        raise UserError(f"names {named or 'nothing'}, and --ckpt names {weights}: the evaluation reads what --ckpt "
                        "names", key="eval.weights", fix="drop the eval.weights override (pass the weights as --ckpt)")
    trained = load_config_file(source.config_path).model
    changed = [f.name for f in fields(trained) if getattr(trained, f.name) != getattr(config.model, f.name)]
    if changed:
        key = changed[0]
        raise UserError(f"{getattr(config.model, key)!r} here, {getattr(trained, key)!r} in the weights' recipe "
                        f"{source.config_path}: the evaluation builds the model the weights were trained as",
                        key=f"model.{key}", fix=f"drop the model.{key} override")
    folders = [weights] if source.weights else [source.source_run / name for name in SIDE_FILE_DIRS]
    policy = check_policy_files(find_side_files(folders), trained, where=str(folders[0]))
    check_suite(policy, trained, config.eval, where=str(folders[0]))
    check_weights_kind(source, config.eval.weights_kind)


def check_weights_kind(source: EvalSource, asked: str | None) -> None:
    """eval.weights_kind against what --ckpt names (None takes what is there): a checkpoint must hold a moving average
    for ema (its .complete marker records the average's decay, null without one); an export holds one kind of weights,
    which export.json records (raw for exports written before the choice existed), and is evaluated only as that."""
    from embodyhpc.checkpoint.integrity import WEIGHTS_KIND_KEY, read_summary

    if asked is None:
        return
    if source.checkpoint is not None:
        if asked == "ema" and layout.read_marker(source.checkpoint).get("ema_decay") is None:
            raise UserError("the checkpoint holds no moving average of the weights (the run trained with "
                            "train.ema_decay: null)", key="eval.weights_kind", where=str(source.checkpoint),
                            fix="evaluate its raw weights: eval.weights_kind=raw, or drop the override")
        return
    assert source.weights is not None
    summary = read_summary(source.weights)
    held = summary.get(WEIGHTS_KIND_KEY, "raw")
    if held != asked:
        origin = summary.get("source")
        raise UserError(f"the export holds the {held} weights, and eval.weights_kind asks for {asked}",
                        key="eval.weights_kind", where=str(source.weights),
                        fix=f"evaluate the checkpoint it was exported from ({origin}) with eval.weights_kind={asked}, "
                            "or drop the override" if origin else "drop the eval.weights_kind override")


def _resolved(path: str) -> Path | None:
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL byte: not the folder --ckpt names
        return None


def source_lock(path: Path, progress: Callable[[str], None] = print) -> AbstractContextManager:
    """`with source_lock(PATH):` around `eval --ckpt PATH`: the shared lock (embodyhpc.runlock) of the training run
    PATH lies in (the run folder, its export/, one of its checkpoints/step-N), held while the evaluation reads the
    run, pins the checkpoint and submits its chain (a chain run here: until it ends; its export job writes the
    run's exports/step-N). Evaluations go on side by side, and beside a chain running here; a resume or cancel of
    that run meanwhile is refused, and the other way round. Weights outside any run: nothing to lock."""
    from contextlib import nullcontext

    from embodyhpc.runlock import run_lock

    run = _run_of(Path(path))
    return nullcontext() if run is None else run_lock(run, "embodyhpc eval", shared=True, progress=progress)


def _run_of(path: Path) -> Path | None:
    import os

    try:
        path = path.expanduser().resolve()
    except (OSError, RuntimeError):  # a symlink loop: resolve_source says so
        return None
    candidates = [path, path.parent]
    if path.parent.name == CHECKPOINTS_DIR:
        candidates.append(path.parent.parent)
    return next((run for run in candidates if os.path.isfile(run / RUN_JSON)), None)


def _mlflow_run(run: Path | None) -> str | None:
    if run is None:
        return None
    try:
        return RunInfo.load(run).mlflow_run_id
    except Exception:  # an unreadable run.json costs the attachment, not the evaluation
        return None


def evaluated_checkpoint(ev: EvalConfig) -> Path | None:
    """The checkpoint folder an evaluation reads (eval.weights = <run>/checkpoints/step-N), else None (an export)."""
    if not ev.weights:
        return None
    path = Path(ev.weights)
    return path if checkpoint_export_dir(path) is not None else None


def checkpoint_export_dir(checkpoint: Path) -> Path | None:
    """Where the export job writes a run's checkpoint: <run>/checkpoints/step-N -> <run>/exports/step-N. Decided by
    the path alone (the checkpoint may be gone by the time an evaluation shard asks); None for other paths."""
    checkpoint = Path(checkpoint)
    if checkpoint.parent.name != CHECKPOINTS_DIR or layout.parse_step(checkpoint.name) is None:
        return None
    return checkpoint.parent.parent / EXPORTS_DIR / checkpoint.name
