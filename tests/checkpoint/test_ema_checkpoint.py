"""The weights' moving average in checkpoints: saved sharded on 2 ranks, resumed bit-exactly on another world size, and
the export (hence evaluation, checkpoint evaluation, the LeRobot export and the logged model, which all read exports)
holding the weights eval.weights_kind names.

What is compared with what: the full (unsharded) average and weights gathered on the saving ranks right before the
save, against what a fresh model and average (other initial values) hold after loading, and against the exported
tensors; the average is perturbed away from the weights first, so an export of the wrong kind cannot pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from embodyhpc.checkpoint import Checkpointer, NotACheckpointError, export_consolidated, layout, load_exported
from embodyhpc.checkpoint.export import built_from
from embodyhpc.config.schema import CheckpointConfig
from embodyhpc.errors import UserError
from embodyhpc.train.ema import ParameterEMA
from tests.checkpoint.distributed import ToySampler, run_ranks, seed_all, sharded_model, train_step

DECAY = 0.75
CONFIG_YAML = "model:\n  name: pi05\n  size: tiny\n"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in tensors.items()}


def _weights(model) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return {k: v.clone() for k, v in get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)).items()}


def save_ema_job(rank: int, world_size: int, out: str) -> None:
    """2 steps of the tiny pi0.5 (FSDP2, AdamW) with an average updated after each; step 2 saved (async) with it."""
    out_dir = Path(out)
    seed_all(100 + rank)
    model, optimizer = sharded_model(init_seed=0)
    ema, sampler = ParameterEMA(model, DECAY), ToySampler(rank, world_size)
    for _ in range(2):
        train_step(model, optimizer, None, sampler)
        ema.update()
    with Checkpointer(out_dir / "checkpoints", CheckpointConfig(every_steps=1, keep_latest_k=2)) as ckpt:
        expected = {"ema": _full(ema.state_dict()), "model": _weights(model)}
        ckpt.save(2, model, optimizer, ema=ema)
        ckpt.wait()
    if rank == 0:
        torch.save(expected, out_dir / "expected.pt")


def load_ema_job(rank: int, world_size: int, loads: list[tuple[str, bool, str]]) -> None:
    """For each (run folder, with an average, result file): a fresh model (and average) of other initial values
    load the folder's newest checkpoint on `world_size` ranks; rank 0 writes what they hold."""
    for folder, with_ema, result in loads:
        model, optimizer = sharded_model(init_seed=5)
        ema = ParameterEMA(model, DECAY) if with_ema else None
        with Checkpointer(Path(folder) / "checkpoints", CheckpointConfig(every_steps=1, keep_latest_k=2)) as ckpt:
            loaded = ckpt.load_latest(model, optimizer, ema=ema)
        found = {"ema_restored": loaded.ema_restored, "saved_world_size": loaded.saved_world_size,
                 "ema": _full(ema.state_dict()) if ema is not None else None, "model": _weights(model)}
        if rank == 0:
            torch.save(found, result)


@pytest.fixture(scope="module")
def saved_with_ema(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saved_with_ema")
    run_ranks(save_ema_job, 2, str(out))
    return out


@pytest.fixture(scope="module")
def loaded_on_one_rank(saved_with_ema, saved_on_two_ranks, tmp_path_factory) -> dict[str, dict]:
    """One 1-rank job: the 2-rank checkpoint with its average loaded with and without an average, and a checkpoint
    saved without one loaded with one."""
    out = tmp_path_factory.mktemp("loaded_on_one_rank")
    loads = {"with": (saved_with_ema, True), "without": (saved_with_ema, False),
             "none saved": (saved_on_two_ranks, True)}
    run_ranks(load_ema_job, 1, [(str(folder), with_ema, str(out / f"{i}.pt"))
                                for i, (folder, with_ema) in enumerate(loads.values())])
    return {name: torch.load(out / f"{i}.pt", weights_only=True) for i, name in enumerate(loads)}


def _expected(folder: Path) -> dict:
    return torch.load(folder / "expected.pt", weights_only=True)


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert got.keys() == want.keys()
    return [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]


def _resumes_bit_exactly(got: dict, saved_with_ema: Path) -> None:
    want = _expected(saved_with_ema)
    assert got["ema_restored"] is True and got["saved_world_size"] == 2
    assert _same(got["ema"], want["ema"]) == [] and _same(got["model"], want["model"]) == []
    assert any(not torch.equal(want["ema"][k], want["model"][k]) for k in want["ema"]), "average == weights"
    assert layout.read_marker(saved_with_ema / "checkpoints" / "step-2")["ema_decay"] == DECAY


def test_the_average_saved_on_two_ranks_resumes_bit_exactly_on_one(loaded_on_one_rank, saved_with_ema):
    _resumes_bit_exactly(loaded_on_one_rank["with"], saved_with_ema)


@pytest.mark.slow  # 3 ranks on 2 cores
def test_the_average_saved_on_two_ranks_resumes_bit_exactly_on_three(saved_with_ema, tmp_path):
    run_ranks(load_ema_job, 3, [(str(saved_with_ema), True, str(tmp_path / "w3.pt"))])
    _resumes_bit_exactly(torch.load(tmp_path / "w3.pt", weights_only=True), saved_with_ema)


def test_a_run_without_an_average_resumes_from_a_checkpoint_with_one_and_back(loaded_on_one_rank, saved_with_ema):
    """A recipe that turned train.ema_decay off resumes (the average stays on disk); one that turned it on finds none
    in an older checkpoint (ema_restored False: the loop starts the average from the loaded weights)."""
    got = loaded_on_one_rank["without"]
    assert got["ema_restored"] is False and _same(got["model"], _expected(saved_with_ema)["model"]) == []
    got = loaded_on_one_rank["none saved"]
    assert got["ema_restored"] is False and got["model"]


def test_the_export_holds_the_kind_the_recipe_names(saved_with_ema, tmp_path):
    step = saved_with_ema / "checkpoints" / "step-2"
    want = _expected(saved_with_ema)
    for asked, kind in ((None, "ema"), ("ema", "ema"), ("raw", "raw")):
        out = tmp_path / str(asked)
        export_consolidated(step, out, config_yaml=CONFIG_YAML, weights_kind=asked)
        weights, summary = load_exported(out)
        assert summary["weights_kind"] == kind and weights.keys() == want["model"].keys()
        assert summary["built_from"] == built_from(step, CONFIG_YAML, kind)
        expected = {**want["model"], **({k: v.to(want["model"][k].dtype) for k, v in want["ema"].items()}
                                        if kind == "ema" else {})}
        assert _same(weights, expected) == [], asked
    assert load_exported(tmp_path / "None")[1]["built_from"] != load_exported(tmp_path / "raw")[1]["built_from"]


def test_the_average_is_refused_in_one_line_where_a_checkpoint_has_none(saved_on_two_ranks, tmp_path):
    step = saved_on_two_ranks / "checkpoints" / "step-3"
    with pytest.raises(NotACheckpointError, match="holds no moving average.*fix: evaluate its raw weights") as caught:
        export_consolidated(step, tmp_path / "out", config_yaml=CONFIG_YAML, weights_kind="ema")
    assert "\n" not in caught.value.one_line() and not (tmp_path / "out").exists()
    export_consolidated(step, tmp_path / "auto", config_yaml=CONFIG_YAML)  # unset: the raw weights, as ever
    summary = load_exported(tmp_path / "auto")[1]
    assert summary["weights_kind"] == "raw" and "weights_kind" not in summary["built_from"]


# ---- the evaluation's choice: the export job (launch/export.py) and `eval --ckpt`'s check (evaluate.py) ----
def _run_with_average(tmp_path: Path) -> tuple[Path, dict, dict]:
    """A local training run of the demo recipe (train.ema_decay=0.9) with a checkpoint step-40 whose average was
    moved away from the weights; (run, raw weights, average)."""
    from embodyhpc.models import build_model
    from embodyhpc.orchestrate.api import start_run
    from embodyhpc.rundir import make_run_dir
    from embodyhpc.validation import load_recipe
    from tests.launch.conftest import RECIPE, side_files

    (tmp_path / "demos").mkdir()
    loaded = load_recipe(RECIPE, [f"job.runs_root={tmp_path}", "train.ema_decay=0.9",
                                  f"data.root={tmp_path / 'demos'}"])
    run = tmp_path / "demo" / "train-run"
    assert make_run_dir(run)
    start_run(loaded, run, backend="local", python=sys.executable, mlflow_run_id=None)
    torch.manual_seed(0)
    model = build_model(loaded.config.model, loaded.config.precision)
    ema = ParameterEMA(model, 0.9)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5)
    ema.update()  # average = weights - 0.45
    with Checkpointer(run / "checkpoints", CheckpointConfig(every_steps=20)) as ckpt:
        ckpt.save(40, model, torch.optim.AdamW(model.parameters()), blocking=True, ema=ema)
    for name, content in side_files(loaded.config.model).items():
        (run / "checkpoints" / name).write_text(json.dumps(content))
    averages = {k: v.clone() for k, v in ema.state_dict().items()}
    return run, {k: v.clone() for k, v in model.state_dict().items()}, averages


def test_the_export_job_exports_the_evaluations_choice(tmp_path):
    from embodyhpc.launch.export import export_task
    from tests.launch.test_export_job import eval_run

    run, raw, average = _run_with_average(tmp_path)
    for name, overrides, kind in (("eval-auto", (), "ema"), ("eval-raw", ("eval.weights_kind=raw",), "raw")):
        result = export_task(str(eval_run(run, name, *overrides)))
        assert result["weights_kind"] == kind
        weights, summary = load_exported(result["export"])
        assert summary["weights_kind"] == kind
        expected = {**raw, **average} if kind == "ema" else raw
        assert _same(weights, expected) == [], name
    # the second (raw) could not reuse exports/step-40 (the average's): it went into its own folder
    assert load_exported(run / "exports" / "step-40")[1]["weights_kind"] == "ema"


def test_eval_ckpt_refuses_a_kind_that_what_it_names_does_not_hold(saved_on_two_ranks, saved_with_ema, tmp_path):
    from embodyhpc.evaluate import EvalSource, check_weights_kind

    def checkpoint(folder: Path) -> EvalSource:
        return EvalSource(folder / "resolved.yaml", None, folder / "checkpoints" / "step-2", folder, None)

    check_weights_kind(checkpoint(saved_with_ema), "ema")
    check_weights_kind(checkpoint(saved_on_two_ranks), "raw")
    check_weights_kind(checkpoint(saved_on_two_ranks), None)
    with pytest.raises(UserError, match="eval.weights_kind: the checkpoint holds no moving average"):
        check_weights_kind(checkpoint(saved_on_two_ranks), "ema")

    export = tmp_path / "export"
    export_consolidated(saved_with_ema / "checkpoints" / "step-2", export, config_yaml=CONFIG_YAML)
    source = EvalSource(export / "config.yaml", export, None, None, None)
    check_weights_kind(source, "ema")
    check_weights_kind(source, None)
    with pytest.raises(UserError, match=r"the export holds the ema weights, and eval.weights_kind asks for raw "
                                        r"\(fix: evaluate the checkpoint it was exported from \(.*step-2\)") as caught:
        check_weights_kind(source, "raw")
    assert "\n" not in caught.value.one_line()
