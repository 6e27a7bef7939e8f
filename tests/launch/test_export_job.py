"""The export job of an evaluation of a checkpoint, against checkpoints that are damaged, of another model, or in a
folder it cannot write: it refuses in one line before writing anything, never writes into or reuses a source run's
exports/step-N that is not built from exactly this checkpoint and recipe, and exports into the evaluation's own
folder when the source cannot take it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from embodyhpc.checkpoint import Checkpointer, NotACheckpointError, layout, load_exported
from embodyhpc.config.schema import CheckpointConfig
from embodyhpc.launch.eval import weights_dir
from embodyhpc.launch.export import export_task
from embodyhpc.models import build_model
from embodyhpc.orchestrate.api import start_run
from embodyhpc.rundir import RUN_JSON, make_run_dir
from embodyhpc.validation import load_recipe, load_resolved

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
REPO = Path(__file__).resolve().parents[2]


def eval_run(source: Path, name: str = "eval-1", *overrides: str) -> Path:
    """An evaluation run of source/checkpoints/step-40, as `embodyhpc eval --ckpt` makes it."""
    checkpoint = source / "checkpoints" / "step-40"
    loaded = load_recipe(str(source / "resolved.yaml"), [f"eval.weights={checkpoint}", *overrides])
    run = source.parent / "evals" / name
    assert make_run_dir(run)
    start_run(loaded, run, backend="local", python=sys.executable, mlflow_run_id=None)
    return run


def resave(source: Path, model: torch.nn.Module) -> None:
    """Replace step-40 with a checkpoint of `model` (a re-saved step: new metadata and marker)."""
    layout.remove_folder(source / "checkpoints" / "step-40")
    with Checkpointer(source / "checkpoints", CheckpointConfig(every_steps=20)) as ckpt:
        ckpt.save(40, model, torch.optim.AdamW(model.parameters()), blocking=True)


def other_model(source: Path, **changes) -> torch.nn.Module:
    import dataclasses

    cfg = load_resolved(source)
    torch.manual_seed(1)
    return build_model(dataclasses.replace(cfg.model, **changes), cfg.precision)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(run: Path, expected: str) -> None:
    with pytest.raises(NotACheckpointError, match=expected) as caught:
        export_task(str(run))
    assert caught.value.exit_code == 2 and "\n" not in caught.value.one_line()


# --- checkpoints that must not be exported ---------------------------------------------------------------

MISMATCHED = [("action_dim-6", lambda s: other_model(s, action_dim=6)),
              ("state_dim-12", lambda s: other_model(s, state_dim=12)),
              ("not-pi05", lambda s: torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)))]


@pytest.mark.parametrize(("case", "make"), MISMATCHED, ids=[c[0] for c in MISMATCHED])
def test_a_checkpoint_of_another_model_is_refused_and_nothing_is_written(training_run, case, make):
    source, _ = training_run
    resave(source, make(source))
    run = eval_run(source)
    refused(run, "do not fit the model")
    assert not (source / "exports").exists() and not (run / "export").exists()


@pytest.mark.parametrize("override", ["model.size=small", "model.action_dim=6", "model.state_dim=12"])
def test_an_evaluation_recipe_for_another_model_is_refused(training_run, override):
    """`embodyhpc eval --ckpt RUN/checkpoints/step-N model.size=small`: the checkpoint holds the run's tiny model."""
    source, _ = training_run
    run = eval_run(source, "eval-1", override)
    refused(run, "do not fit the model this evaluation's recipe")
    assert not (source / "exports").exists() and not (run / "export").exists()


def _drop(name):
    return lambda step: (step / name).unlink()


def _first_shard(step: Path) -> Path:
    return sorted(step.glob("*.distcp"))[0]


DAMAGED = [
    ("metadata-missing", _drop(".metadata"), "no .metadata file"),
    ("metadata-empty", lambda s: os.truncate(s / ".metadata", 0), "unreadable .metadata"),
    ("metadata-truncated", lambda s: os.truncate(s / ".metadata", 100), "unreadable .metadata"),
    ("metadata-garbage", lambda s: (s / ".metadata").write_bytes(os.urandom(4000)), "unreadable .metadata"),
    ("shard-missing", lambda s: _first_shard(s).unlink(), "is missing"),
    ("shard-truncated", lambda s: os.truncate(_first_shard(s), 1000), "is truncated"),
    ("shard-empty", lambda s: os.truncate(_first_shard(s), 0), "is truncated"),
    ("shard-garbage-same-size",
     lambda s: _first_shard(s).write_bytes(os.urandom(_first_shard(s).stat().st_size)), "shards cannot be read"),
]


@pytest.mark.parametrize(("case", "damage", "expected"), DAMAGED, ids=[c[0] for c in DAMAGED])
def test_a_damaged_checkpoint_is_refused_in_one_line(training_run, case, damage, expected):
    source, _ = training_run
    run = eval_run(source)
    damage(source / "checkpoints" / "step-40")
    refused(run, expected)
    assert not (source / "exports" / "step-40" / "export.json").exists() and not (run / "export").exists()
    assert layout.pinned_by(source / "checkpoints" / "step-40") == []  # unpinned all the same


@pytest.mark.parametrize("case", ["metadata-missing", "metadata-empty"])
def test_eval_refuses_a_checkpoint_without_metadata_before_making_a_run(cli, training_run, runs_root, case):
    source, _ = training_run
    step = source / "checkpoints" / "step-40"
    dict((c[0], c[1]) for c in DAMAGED)[case](step)
    result = cli("eval", "--ckpt", str(step), "--local", f"job.runs_root={runs_root}")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1 and ".metadata" in result.err
    assert list(runs_root.iterdir()) == []


# --- keyed exports ---------------------------------------------------------------------------------------


def test_an_export_of_another_checkpoint_is_neither_reused_nor_overwritten(training_run):
    """step-40 exported, then re-saved with other weights (a restarted run): the next evaluation exports the new
    checkpoint into its own folder and evaluates that; the first export stays as it was."""
    source, _ = training_run
    first = eval_run(source, "eval-1")
    assert export_task(str(first))["written"]
    canonical = source / "exports" / "step-40"
    before = tree(canonical)
    new_model = other_model(source)
    resave(source, new_model)
    second = eval_run(source, "eval-2")
    result = export_task(str(second))
    assert result["export"] == str(second / "export") and result["written"]
    assert tree(canonical) == before
    assert weights_dir(load_resolved(second), second) == second / "export"
    weights, _ = load_exported(second / "export")
    for key, tensor in new_model.state_dict().items():
        assert torch.equal(weights[key], tensor), key
    assert weights_dir(load_resolved(first), first) == canonical  # the first evaluation still reads its own


def test_an_export_with_another_recipe_is_not_reused(training_run):
    source, _ = training_run
    export_task(str(eval_run(source, "eval-1")))
    text = (source / "resolved.yaml").read_text()
    (source / "resolved.yaml").write_text(text.replace("seed: 0", "seed: 1", 1) if "seed: 0" in text
                                          else text + "\n")
    second = eval_run(source, "eval-2")
    assert export_task(str(second))["export"] == str(second / "export")


DAMAGED_EXPORTS = [
    ("weights-truncated", lambda e: os.truncate(e / "model.safetensors", 100)),
    ("weights-flipped", lambda e: (e / "model.safetensors").write_bytes(
        (e / "model.safetensors").read_bytes()[:-1] + b"\x01")),
    ("config-edited", lambda e: (e / "config.yaml").write_text("model: {size: small}\n")),
    ("export-json-without-hash", lambda e: (e / "export.json").write_text(json.dumps(
        {k: v for k, v in json.loads((e / "export.json").read_text()).items() if k != "sha256"}))),
    ("statistics-edited", lambda e: (e / "normalization.json").write_text(
        (e / "normalization.json").read_text().replace("0.5", "0.25"))),
    ("policy-io-deleted", lambda e: (e / "policy_io.json").unlink()),
    ("tokenizer-dropped-in", lambda e: (e / "tokenizer.json").write_text("{}")),
]


@pytest.mark.parametrize(("case", "damage"), DAMAGED_EXPORTS, ids=[c[0] for c in DAMAGED_EXPORTS])
def test_a_damaged_step_export_is_not_reused(training_run, case, damage):
    source, model = training_run
    export_task(str(eval_run(source, "eval-1")))
    canonical = source / "exports" / "step-40"
    damage(canonical)
    before = tree(canonical)
    second = eval_run(source, "eval-2")
    assert export_task(str(second))["export"] == str(second / "export")
    assert tree(canonical) == before  # left as found: never written into on a mismatch
    weights, _ = load_exported(weights_dir(load_resolved(second), second))
    for key, tensor in model.state_dict().items():
        assert torch.equal(weights[key], tensor), key


def test_the_export_copies_the_run_s_side_files_and_records_their_hashes(training_run):
    import hashlib

    source, _ = training_run
    export_task(str(eval_run(source)))
    canonical = source / "exports" / "step-40"
    recorded = json.loads((canonical / "export.json").read_text())["side_files"]
    expected = {name: hashlib.sha256((source / "checkpoints" / name).read_bytes()).hexdigest()
                for name in ("normalization.json", "policy_io.json")}
    assert recorded == {**expected, "tokenizer.model": None, "tokenizer.json": None}
    for name in expected:
        assert (canonical / name).read_bytes() == (source / "checkpoints" / name).read_bytes()


@pytest.mark.parametrize(("name", "content", "expected"), [
    ("normalization.json", '{"key": "observation.environment_state", "mode": "mean_std", "offset": [NaN], '
                           '"scale": [1.0]}', r"offset\[0\]: nan is not finite"),
    ("policy_io.json", '{"cameras": "corner"}', "not a list of camera names"),
    ("policy_io.json", "", "unreadable"),
])
def test_broken_side_files_are_refused_before_the_export_is_written(training_run, name, content, expected):
    """An evaluation beside training goes through the export job, not `eval --ckpt`: it checks them too."""
    from embodyhpc.errors import UserError

    source, _ = training_run
    (source / "checkpoints" / name).write_text(content)
    run = eval_run(source)
    with pytest.raises(UserError, match=expected) as caught:
        export_task(str(run))
    assert str(source / "checkpoints" / name) in caught.value.one_line()
    assert not (source / "exports").exists() and not (run / "export").exists()
    assert layout.pinned_by(source / "checkpoints" / "step-40") == []


def test_a_whole_matching_export_is_reused(training_run):
    source, _ = training_run
    export_task(str(eval_run(source, "eval-1")))
    second = eval_run(source, "eval-2")
    result = export_task(str(second))
    assert result == {**result, "export": str(source / "exports" / "step-40"), "written": False}
    assert not (second / "export").exists()


# --- a source the evaluation cannot write ------------------------------------------------------------------

READ_ONLY_SCRIPT = textwrap.dedent("""
    import json, sys, warnings
    from pathlib import Path
    warnings.filterwarnings("ignore")
    from embodyhpc.checkpoint import layout, load_exported
    from embodyhpc.validation import load_recipe, load_resolved
    from embodyhpc.launch.eval import weights_dir
    from embodyhpc.launch.export import export_task
    from embodyhpc.rundir import make_run_dir
    from embodyhpc.orchestrate.api import start_run

    source, run = Path(sys.argv[1]), Path(sys.argv[2])
    checkpoint = source / "checkpoints" / "step-40"
    probe = source / "probe"
    try:
        probe.write_text("x")
        writable = True
    except OSError:
        writable = False
    loaded = load_recipe(str(source / "resolved.yaml"), [f"eval.weights={checkpoint}"])
    assert make_run_dir(run)
    start_run(loaded, run, backend="local", python=sys.executable, mlflow_run_id=None)
    result = export_task(str(run))
    weights, summary = load_exported(weights_dir(load_resolved(run), run))
    print(json.dumps({"writable": writable, "result": result, "step": summary["step"],
                      "num_tensors": len(weights)}))
""")


def _run_with_source_read_only(source: Path, run: Path) -> dict:
    """Run READ_ONLY_SCRIPT while `source` is read-only: a read-only bind mount in a mount namespace of its own as
    root (root ignores file modes), file modes otherwise."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", READ_ONLY_SCRIPT, str(source), str(run)]
    if os.geteuid() == 0:
        assert shutil.which("unshare"), "unshare (util-linux) is needed to make a read-only folder as root"
        command = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && '
                   'exec "$@"', str(source), *command]
    else:
        subprocess.run(["chmod", "-R", "a-w", str(source)], check=True)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    finally:
        if os.geteuid() != 0:
            subprocess.run(["chmod", "-R", "u+w", str(source)], check=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_checkpoint_in_a_read_only_run_is_exported_into_the_evaluation(training_run, tmp_path):
    source, _ = training_run
    before = tree(source)
    run = tmp_path / "elsewhere" / "eval-ro"
    out = _run_with_source_read_only(source, run)
    assert out["writable"] is False  # the source really was read-only
    assert out["result"]["export"] == str(run / "export") and out["result"]["written"]
    assert out["step"] == 40 and out["num_tensors"] > 0
    assert tree(source) == before and not (source / "exports").exists()
    assert (run / RUN_JSON).is_file()


def test_a_run_folder_that_cannot_be_started_is_removed(cli, training_run, runs_root):
    """A pin that cannot be written for another reason than permissions (pins/ is a file): one line, exit 2, and
    no run folder without run.json."""
    source, _ = training_run
    step = source / "checkpoints" / "step-40"
    (step / "pins").write_text("not a folder")
    result = cli("eval", "--ckpt", str(step), "--local", f"job.runs_root={runs_root}")
    assert result.code == 2 and len(result.err.strip().splitlines()) == 1 and "cannot pin" in result.err
    assert [p for p in runs_root.rglob("*") if p.is_dir() and not (p / RUN_JSON).exists()
            and p.parent != runs_root] == []
    assert not any(runs_root.rglob(RUN_JSON))


def test_the_trained_policy_loads_a_whole_export_and_refuses_one_that_does_not_fit(training_run, tmp_path):
    """load_trained_policy (what every evaluation shard runs) after the export job; an export whose weights
    are of another model than its config.yaml (exported by hand) is refused in one line, not a traceback."""
    from embodyhpc.eval.trained import load_trained_policy
    from tests.exports import make_export

    source, model = training_run
    run = eval_run(source)
    export_task(str(run))
    exported = weights_dir(load_resolved(run), run)
    policy = load_trained_policy(exported, execute_steps=2)
    assert policy.step == 40
    for key, tensor in model.state_dict().items():
        assert torch.equal(policy.model.state_dict()[key], tensor.float()), key
    wrong = make_export(tmp_path / "wrong", other_model(source, action_dim=6),
                        config_yaml=(source / "resolved.yaml").read_text())
    with pytest.raises(NotACheckpointError, match="do not fit the model") as caught:
        load_trained_policy(wrong, execute_steps=2)
    assert "\n" not in caught.value.one_line()
