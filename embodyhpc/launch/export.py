"""The export job: first job of an evaluation whose eval.weights is a training run's checkpoints/step-N folder
(`embodyhpc eval --ckpt RUN/checkpoints/step-N`, and every evaluation of a checkpoint while training runs).

One process reads the complete DCP folder (model entries only, no collectives) and writes the run's
exports/step-N/ (model.safetensors, config.yaml = the run's resolved recipe, export.json last), plus the files
that tell an evaluation how the policy was fed in training (normalization.json, policy_io.json: the training job
writes them next to its checkpoints when it starts; runs from before that have them in export/). A folder that
is already whole (export.json present) is not written again. Whatever happens, it then removes this evaluation's
pin from the checkpoint, so that the training run's retention may delete it later.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from embodyhpc.checkpoint import layout
from embodyhpc.config.load import load_resolved
from embodyhpc.data.normalize import NORM_FILE
from embodyhpc.eval.trained import POLICY_IO_FILE
from embodyhpc.evaluate import CHECKPOINTS_DIR, checkpoint_export_dir, evaluated_checkpoint
from embodyhpc.launch.eval import EXPORT_DIR
from embodyhpc.rundir import RESOLVED_YAML

SIDE_FILES = (NORM_FILE, POLICY_IO_FILE)
SIDE_FILE_DIRS = (CHECKPOINTS_DIR, EXPORT_DIR)  # where a training run keeps them: first found wins


def export_task(run_dir: str) -> dict:
    run = Path(run_dir)
    checkpoint = evaluated_checkpoint(load_resolved(run).eval)
    if checkpoint is None:
        raise ValueError(f"{run}: eval.weights is not a run's checkpoints/step-N folder; nothing to export")
    try:
        return export_checkpoint(checkpoint)
    finally:
        layout.unpin(checkpoint, owner=run)


def export_checkpoint(checkpoint: Path) -> dict:
    """<run>/checkpoints/step-N -> <run>/exports/step-N (once), with the run's side files."""
    from embodyhpc.checkpoint.export import EXPORT_JSON, export_consolidated

    out = checkpoint_export_dir(checkpoint)
    assert out is not None  # evaluated_checkpoint checked the path's shape
    source_run = checkpoint.parent.parent
    written = not (out / EXPORT_JSON).is_file()
    if written:
        print(f"export: {checkpoint} -> {out}", flush=True)
        export_consolidated(checkpoint, out, config_yaml=(source_run / RESOLVED_YAML).read_text())
    else:
        print(f"export: {out} is already whole", flush=True)
    copied = []
    for name in SIDE_FILES:
        found = next((source_run / d / name for d in SIDE_FILE_DIRS if (source_run / d / name).is_file()), None)
        if found is not None:
            shutil.copy2(found, out / name)
            copied.append(name)
    return {"checkpoint": str(checkpoint), "export": str(out), "written": written, "side_files": copied}
