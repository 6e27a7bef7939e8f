"""The export job: first job of an evaluation whose eval.weights is a training run's checkpoints/step-N folder
(`embodyhpc eval --ckpt RUN/checkpoints/step-N`, and every evaluation of a checkpoint while training runs).

One process reads the complete DCP folder (model entries only, no collectives) and writes the run's
exports/step-N/ (model.safetensors, config.yaml = the run's resolved recipe, the files that tell an evaluation how
the policy was fed in training: normalization.json, policy_io.json, the tokenizer copy, which the training job
writes next to its checkpoints when it starts (runs from before that have them in export/), and export.json last,
with the sha256 of each). A folder that is already whole (export.json present) is not written again. Whatever
happens, it then removes this evaluation's pin from the checkpoint, so that the training run's retention may delete
it later.

Before anything is written the checkpoint must be readable (metadata, shard sizes), its model must fit the
model of both the run's recipe and the evaluation's (another model size or action_dim is refused in one line), and
its side files must hold what the run's recipe says (eval/policy_files.py: no NaN statistics, no other state key).
Which weights: the evaluation's eval.weights_kind (ema: the moving average of train.ema_decay; raw; unset: the average
when the checkpoint has one), refused in one line before anything is written when it asks for an average the
checkpoint does not hold (checkpoint.export.choose_weights); export.json records the choice.
The export is keyed by what it is built from (integrity.built_from: the checkpoint's metadata and marker, the
recipe, and an average's export being one): exports/step-N is reused only when it is whole, unchanged and built from
exactly this; it is written only when it does not exist yet. Otherwise (an export of something else is there, it is
damaged, or the source run cannot be written, e.g. a read-only folder) the export goes into the evaluation's own
folder, <eval run>/export, which the shards then read (launch.eval.weights_dir).
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

from embodyhpc.checkpoint import layout
from embodyhpc.checkpoint.errors import NotACheckpointError
from embodyhpc.eval.policy_files import SIDE_FILES, check_policy_files, find_side_files
from embodyhpc.evaluate import SIDE_FILE_DIRS, checkpoint_export_dir, evaluated_checkpoint
from embodyhpc.rundir import EXPORT_DIR, RESOLVED_YAML
from embodyhpc.validation import load_resolved

__all__ = ["SIDE_FILES", "SIDE_FILE_DIRS", "export_checkpoint", "export_task"]


def export_task(run_dir: str) -> dict:
    run = Path(run_dir)
    config = load_resolved(run)
    checkpoint = evaluated_checkpoint(config.eval)
    if checkpoint is None:
        raise ValueError(f"{run}: eval.weights is not a run's checkpoints/step-N folder; nothing to export")
    try:
        return export_checkpoint(checkpoint, eval_run=run, eval_config=config)
    finally:
        try:
            layout.unpin(checkpoint, owner=run)
        except OSError as exc:  # a read-only source run: it was never pinned either
            print(f"export: could not unpin {checkpoint} ({exc.strerror or exc})", flush=True)


_CANNOT_WRITE = (errno.EACCES, errno.EPERM, errno.EROFS)


def export_checkpoint(checkpoint: Path, *, eval_run: Path | None = None, eval_config: Any = None) -> dict:
    """<run>/checkpoints/step-N -> <run>/exports/step-N (once, keyed by what it is built from), with the run's side
    files; into <eval_run>/export where the run's exports/step-N cannot be used (module docstring)."""
    from embodyhpc.checkpoint.export import (
        EXPORT_JSON,
        built_from,
        check_fits,
        choose_weights,
        export_consolidated,
        has_average,
        model_entries,
    )
    from embodyhpc.checkpoint.integrity import verify_export
    from embodyhpc.validation import load_config_file

    canonical = checkpoint_export_dir(checkpoint)
    assert canonical is not None  # evaluated_checkpoint checked the path's shape
    source_run = checkpoint.parent.parent
    config_yaml = (source_run / RESOLVED_YAML).read_text()
    entries = model_entries(checkpoint)
    source_config = load_config_file(source_run / RESOLVED_YAML)
    check_fits(entries, source_config.model, where=str(checkpoint),
               built_with=str(source_run / RESOLVED_YAML))
    if eval_config is not None and eval_run is not None:
        check_fits(entries, eval_config.model, where=str(checkpoint),
                   built_with=f"this evaluation's recipe ({eval_run / RESOLVED_YAML})")
    requested = (eval_config if eval_config is not None else source_config).eval.weights_kind
    kind = choose_weights(requested, has_average(checkpoint), where=str(checkpoint))
    key = built_from(checkpoint, config_yaml, kind)
    side_files = find_side_files([source_run / name for name in SIDE_FILE_DIRS])
    # broken statistics are refused here, not in every shard
    check_policy_files(side_files, source_config.model, where=str(source_run / SIDE_FILE_DIRS[0]))
    own = eval_run / EXPORT_DIR if eval_run is not None else None
    out, written, why = canonical, False, ""
    if (canonical / EXPORT_JSON).is_file():
        try:
            verify_export(canonical, expect_built_from=key)
        except NotACheckpointError as exc:
            why = f"{canonical} cannot be reused ({exc.one_line()})"
    else:
        try:
            print(f"export: {checkpoint} -> {canonical}", flush=True)
            export_consolidated(checkpoint, canonical, config_yaml=config_yaml, side_files=side_files,
                                weights_kind=kind)
            written = True
        except OSError as exc:
            if exc.errno not in _CANNOT_WRITE:
                raise
            why = f"cannot write {canonical} ({exc.strerror})"
    if why:
        if own is None:
            raise NotACheckpointError(why, fix="evaluate it through `embodyhpc eval --ckpt`, which exports into "
                                      "the evaluation's own folder")
        print(f"export: {why}; exporting into this evaluation's folder: {own}", flush=True)
        out = own
        export_consolidated(checkpoint, out, config_yaml=config_yaml, side_files=side_files, weights_kind=kind)
        written = True
    elif not written:
        print(f"export: {out} is already whole", flush=True)
    copied = [name for name, found in side_files.items() if found is not None] if written else []
    return {"checkpoint": str(checkpoint), "export": str(out), "written": written, "side_files": copied,
            "weights_kind": kind}
