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
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from embodyhpc.checkpoint import layout
from embodyhpc.checkpoint.integrity import CONFIG_FILE, DCP_METADATA, EXPORT_JSON, WEIGHTS_FILE, verify_export
from embodyhpc.config.schema import EvalConfig
from embodyhpc.errors import UserError
from embodyhpc.rundir import CHECKPOINTS_DIR, EXPORT_DIR, EXPORTS_DIR, RESOLVED_YAML, RUN_JSON, RunInfo

EXPORT_FILES = (EXPORT_JSON, CONFIG_FILE, WEIGHTS_FILE)


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
        return resolve_source(path / EXPORT_DIR)
    if all((path / name).is_file() for name in EXPORT_FILES):
        verify_export(path)  # size, header and sha256 against export.json: one line (exit 2) when they differ
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
