"""`embodyhpc eval --ckpt PATH`: which folders it accepts, and bad input as one line with exit code 2."""

from __future__ import annotations

import json

from embodyhpc.evaluate import resolve_source


def _export(folder):
    from tests.exports import make_export

    return make_export(folder)


def _run(tmp_path, mlflow_run_id="abc123"):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({
        "run_id": "r", "run_dir": str(run), "backend": "local", "recipe": "x", "site": None, "overrides": [],
        "python": "py", "created": "now", "jobs": {}, "mlflow_run_id": mlflow_run_id}))
    (run / "resolved.yaml").write_text("job: {name: x}\n")
    return run


def test_export_folder_of_a_run_attaches_to_its_mlflow_run(tmp_path):
    run = _run(tmp_path)
    source = resolve_source(_export(run / "export"))
    assert source.weights == run / "export" and source.checkpoint is None
    assert source.config_path == run / "export" / "config.yaml" and source.mlflow_parent == "abc123"
    assert resolve_source(run) == source  # a run directory means its export


def test_complete_checkpoint_uses_the_run_recipe(tmp_path):
    run = _run(tmp_path)
    from tests.exports import save_checkpoint, small_model

    step = save_checkpoint(run / "checkpoints", small_model())
    source = resolve_source(step)
    assert source.weights is None and source.checkpoint == step and source.config_path == run / "resolved.yaml"
    assert source.source_run == run and source.mlflow_parent == "abc123"


def test_a_lone_export_has_no_mlflow_parent(tmp_path):
    source = resolve_source(_export(tmp_path / "weights"))
    assert source.mlflow_parent is None and source.source_run is None


def test_bad_paths_are_one_line_errors_with_exit_2(cli, tmp_path):
    incomplete = tmp_path / "run" / "checkpoints" / "step-7"
    incomplete.mkdir(parents=True)
    cases = [(tmp_path / "missing", "does not exist"), (incomplete, "incomplete checkpoint"),
             (tmp_path / "run", "neither an export folder")]
    for path, message in cases:
        result = cli("eval", "--ckpt", str(path))
        assert result.code == 2, (path, result.err)
        assert message in result.err and "--ckpt" in result.err and len(result.err.strip().splitlines()) == 1


def test_a_complete_checkpoint_moved_out_of_checkpoints_is_refused(tmp_path):
    """The export job and the shards find a checkpoint's export from its path (<run>/checkpoints/step-N)."""
    import pytest

    from embodyhpc.errors import UserError

    run = _run(tmp_path)
    step = run / "saved" / "step-40"
    step.mkdir(parents=True)
    (step / ".complete").write_text("{}")
    with pytest.raises(UserError, match="not in a checkpoints/ folder"):
        resolve_source(step)
