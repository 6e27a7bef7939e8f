"""`embodyhpc eval --ckpt` checks every input the submitting machine can check before it creates anything: the side
files the policy is fed by (their contents against the weights' recipe), the suite (cameras, action size), the
key=value overrides (eval.weights, model.*, eval.seeds) and the path itself. Each mistake is one line with exit 2
and no run folder; before these checks each created a run folder and failed every shard ("eval FAILED (1 shard(s)
failed)") or, worse, evaluated something else without a word."""

from __future__ import annotations

import json
import warnings

import pytest

from embodyhpc.checkpoint import layout
from embodyhpc.validation import load_recipe
from tests.launch.conftest import RECIPE, side_files

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint of the demo recipe's tiny pi0.5 and the recipe's YAML, to export with chosen side files."""
    from embodyhpc.models import build_model
    from tests.exports import save_checkpoint

    root = tmp_path_factory.mktemp("trained")
    (root / "demos").mkdir()
    loaded = load_recipe(RECIPE, [f"data.root={root / 'demos'}"])
    step = save_checkpoint(root / "checkpoints", build_model(loaded.config.model, loaded.config.precision))
    return step, loaded.to_yaml(), side_files(loaded.config.model)


def export_with(tmp_path, trained, name="export", **changes):
    """An export as training writes one, its side files replaced by `changes` ({file name: content, or None for
    no such file}) before export.json records their hashes: what a training run with broken inputs leaves."""
    from embodyhpc.checkpoint.export import export_consolidated

    step, config_yaml, files = trained
    sources = tmp_path / f"{name}-side"
    sources.mkdir()
    side = {"tokenizer.model": None, "tokenizer.json": None}
    for file_name, content in {**files, **changes}.items():
        side[file_name] = None
        if content is not None:
            side[file_name] = sources / file_name
            side[file_name].write_text(content if isinstance(content, str) else json.dumps(content))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        export_consolidated(step, tmp_path / name, config_yaml=config_yaml, side_files=side)
    return tmp_path / name


def refused(cli, runs_root, ckpt, *args, expected: str) -> str:
    result = cli("eval", "--ckpt", str(ckpt), "--local", f"job.runs_root={runs_root}", "eval.shards=1",
                 "eval.episodes_per_task=1", *args)
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1 and "Traceback" not in result.err, result.err
    assert expected in lines[0], lines[0]
    assert list(runs_root.iterdir()) == []  # nothing created
    return lines[0]


NORM = side_files(load_recipe(RECIPE, ["data.root=/tmp"]).config.model)["normalization.json"]
IO = side_files(load_recipe(RECIPE, ["data.root=/tmp"]).config.model)["policy_io.json"]

# (case, side files as training left them, what the one line says)
BROKEN_SIDE_FILES = [
    ("statistics-with-nan", {"normalization.json": {**NORM, "offset": [float("nan")] + NORM["offset"][1:]}},
     "normalization.json: offset[0]: nan is not finite"),
    ("statistics-with-negative-scale", {"normalization.json": {**NORM, "scale": [-1.0] + NORM["scale"][1:]}},
     "scale[0]: -1.0 is negative"),
    ("statistics-not-json", {"normalization.json": "{"}, "normalization.json: unreadable"),
    ("statistics-of-another-state", {"normalization.json": {**NORM, "key": "observation.state"}},
     "statistics of 'observation.state'"),
    ("statistics-missing-while-the-recipe-normalises", {"normalization.json": None},
     "model.state_norm=mean_std, and no normalization.json"),
    ("policy-io-not-json", {"policy_io.json": "{"}, "policy_io.json: unreadable"),
    ("policy-io-a-list", {"policy_io.json": "[]"}, "policy_io.json: not a JSON object"),
    ("policy-io-cameras-a-string", {"policy_io.json": {**IO, "cameras": "corner"}}, "not a list of camera names"),
    ("camera-the-suite-does-not-render", {"policy_io.json": {**IO, "cameras": ["corner", "wrist"]}},
     "camera 'wrist', which the metaworld suite does not render"),
    ("more-action-dims-than-the-weights", {"policy_io.json": {**IO, "action_dim": 7}},
     "7 action dims, but the weights predict model.action_dim=4"),
    ("another-state-key", {"policy_io.json": {**IO, "state_key": "observation.state"}}, "policy_io.json: state_key"),
    ("image-size-text", {"policy_io.json": {**IO, "image_size": "64"}}, "image_size: '64' is not a positive"),
]


@pytest.mark.parametrize(("case", "changes", "expected"), BROKEN_SIDE_FILES, ids=[c[0] for c in BROKEN_SIDE_FILES])
def test_broken_side_files_of_an_export_are_refused_before_a_run_exists(cli, tmp_path, runs_root, trained, case,
                                                                        changes, expected):
    export = export_with(tmp_path, trained, **changes)
    refused(cli, runs_root, export, expected=expected)


def _other_export(tmp_path, trained):
    return str(export_with(tmp_path, trained, name="other"))


# (case, overrides given the tmp folder and the module's checkpoint, what the one line says)
BAD_OVERRIDES = [
    ("weights-that-do-not-exist", lambda t, tr: ["eval.weights=/nonexistent/export"], "eval.weights: names"),
    ("weights-emptied", lambda t, tr: ["eval.weights="], "eval.weights: names nothing"),
    ("weights-null", lambda t, tr: ["eval.weights=null"], "eval.weights: names nothing"),
    ("weights-of-another-export", lambda t, tr: [f"eval.weights={_other_export(t, tr)}"], "eval.weights: names"),
    ("another-action-dim", lambda t, tr: ["model.action_dim=6"], "model.action_dim: 6 here, 4 in the weights"),
    ("another-model-size", lambda t, tr: ["model.size=small"], "model.size: 'small' here, 'tiny'"),
    ("no-normalisation", lambda t, tr: ["model.state_norm=none"], "model.state_norm: 'none' here"),
    ("another-suite", lambda t, tr: ["--suite", "pusht", "eval.tasks=[pusht]"],
     "camera 'corner', which the pusht suite does not render"),
    ("a-video-camera-the-suite-lacks", lambda t, tr: ["eval.suite_options={video_camera: nosuch}"],
     "eval.suite_options.video_camera: 'nosuch' is not a camera"),
    ("a-negative-seed", lambda t, tr: ["eval.seeds=[-1]"], "eval.seeds: -1 is not a seed"),
    ("a-seed-past-32-bits", lambda t, tr: [f"eval.seeds=[{2**32}]"], f"eval.seeds: {2**32} is not a seed"),
    ("a-seed-twice", lambda t, tr: ["eval.seeds=[3, 3]"], "seed 3 is listed twice"),
]


@pytest.mark.parametrize(("case", "overrides", "expected"), BAD_OVERRIDES, ids=[c[0] for c in BAD_OVERRIDES])
def test_overrides_that_contradict_the_weights_are_refused(cli, tmp_path, runs_root, trained, case, overrides,
                                                           expected):
    export = export_with(tmp_path, trained)
    refused(cli, runs_root, export, *overrides(tmp_path, trained), expected=expected)


def _check(ckpt, *overrides):
    """What the CLI runs before it submits: resolve --ckpt, load the recipe as eval does, check_inputs."""
    from embodyhpc.evaluate import check_inputs, resolve_source

    source = resolve_source(ckpt)
    weights = source.weights or source.checkpoint
    loaded = load_recipe(str(source.config_path), [f"eval.weights={weights}", *overrides], recipe_site_keys="drop")
    check_inputs(source, loaded.config)
    return source


def test_a_whole_export_passes_every_check(tmp_path, trained):
    export = export_with(tmp_path, trained)
    assert _check(export, "eval.seeds=[0, 1]", "eval.tasks=[MT10]").weights == export
    # the same weights by another spelling of the path are the same weights
    assert _check(export, f"eval.weights={tmp_path}/./export").weights == export


def test_an_export_from_before_side_files_were_hashed_still_passes(tmp_path, trained):
    export = export_with(tmp_path, trained)
    summary = json.loads((export / "export.json").read_text())
    del summary["side_files"]
    (export / "export.json").write_text(json.dumps(summary))
    _check(export)
    (export / "normalization.json").write_text("{")  # read as it is now: its contents are still checked
    with pytest.raises(Exception, match="normalization.json: unreadable"):
        _check(export)


# --- a checkpoint of a run: the side files the export job will copy are checked --------------------------------


def test_a_checkpoint_with_whole_side_files_passes(training_run):
    run, _ = training_run
    source = _check(run / "checkpoints" / "step-40")
    assert source.checkpoint == run / "checkpoints" / "step-40"


def test_side_files_a_run_kept_in_export_only_are_found_there(training_run):
    """Runs from before side files were written next to the checkpoints have them in export/ only."""
    run, _ = training_run
    (run / "export").mkdir()
    (run / "checkpoints" / "policy_io.json").rename(run / "export" / "policy_io.json")
    _check(run / "checkpoints" / "step-40")
    (run / "export" / "policy_io.json").write_text(json.dumps({"cameras": ["nosuch"]}))
    with pytest.raises(Exception, match="camera 'nosuch'"):
        _check(run / "checkpoints" / "step-40")


CHECKPOINT_SIDE_FILES = [
    ("statistics-with-nan", "normalization.json", lambda d: {**d, "scale": [float("nan")] * 39},
     "scale[0]: nan is not finite"),
    ("statistics-emptied", "normalization.json", lambda d: "", "normalization.json: unreadable"),
    ("camera-the-suite-does-not-render", "policy_io.json", lambda d: {**d, "cameras": ["nosuch"]},
     "camera 'nosuch'"),
]


@pytest.mark.parametrize(("case", "name", "change", "expected"), CHECKPOINT_SIDE_FILES,
                         ids=[c[0] for c in CHECKPOINT_SIDE_FILES])
def test_broken_side_files_of_a_checkpoint_are_refused_before_a_run_exists(cli, training_run, runs_root, case, name,
                                                                           change, expected):
    run, _ = training_run
    path = run / "checkpoints" / name
    content = change(json.loads(path.read_text()))
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    step = run / "checkpoints" / "step-40"
    line = refused(cli, runs_root, step, expected=expected)
    assert str(path) in line
    assert layout.pinned_by(step) == [] and not (run / "exports").exists() and not (run / "evals").exists()


def test_a_run_without_an_export_names_its_newest_checkpoint(cli, training_run, runs_root):
    run, _ = training_run
    refused(cli, runs_root, run, expected=f"the run has no export/ (training has not finished, or did not export) "
                                          f"(fix: evaluate its newest complete checkpoint: --ckpt "
                                          f"{run / 'checkpoints' / 'step-40'})")
