"""A fresh run fine-tuning from a LeRobot pi0.5 policy folder (weights + normaliser state + tokenizer, at the tiny
shapes) normalises with the checkpoint's statistics and prompts with its tokenizer, and writes both where a resumed
run and an evaluation read them; the resumed run keeps them whatever the recipe and the init checkpoint say now."""

from __future__ import annotations

import json

import pytest
import torch

from embodyhpc.models import build_model
from tests.helpers import require
from tests.models import published_assets as pa
from tests.parallel.harness import run_ranks
from tests.train import workers as loop_workers

pytestmark = pytest.mark.slow  # two short 2-rank training runs (~40-60 s here)


def test_a_run_uses_the_checkpoints_statistics_and_tokenizer_and_keeps_them_on_resume(tmp_path):
    require("sentencepiece", "train")
    options = {"state_norm": "quantile"}
    cfg = loop_workers.recipe(2, steps=2, every_steps=2, model_options=options)
    torch.manual_seed(3)
    folder = pa.lerobot_policy_folder(tmp_path / "pi05_libero", build_model(cfg.model))
    run = tmp_path / "run"
    run_ranks(loop_workers.train_job, 2, str(run), 2, 2,
              {"init_weights": str(folder), "model_options": options}, timeout_s=300)

    offset = [(a + b) / 2 for a, b in zip(pa.CHECKPOINT_Q01, pa.CHECKPOINT_Q99, strict=True)]
    scale = [(b - a) / 2 for a, b in zip(pa.CHECKPOINT_Q01, pa.CHECKPOINT_Q99, strict=True)]
    tokenizer = (folder / "tokenizer" / "tokenizer.model").read_bytes()
    for where in (run / "checkpoints", run / "export"):  # what resume and the evaluation read
        stats = json.loads((where / "normalization.json").read_text())
        assert stats["mode"] == "quantile" and stats["key"] == "observation.state"
        assert stats["offset"] == pytest.approx(offset) and stats["scale"] == pytest.approx(scale), where
        assert (where / "tokenizer.model").read_bytes() == tokenizer, where
    _side_files_are_hashed(run / "export")
    dataset_stats = json.loads((loop_workers.FIXTURE / "meta" / "stats.json").read_text())["observation.state"]
    assert stats["offset"][0] != pytest.approx((dataset_stats["q01"][0] + dataset_stats["q99"][0]) / 2)

    # evaluation: the policy reads the tokenizer copy beside the weights, whatever the recipe's tokenizer_path says
    from embodyhpc.config.schema import Config
    from embodyhpc.eval.trained import with_export_tokenizer

    assert with_export_tokenizer(Config(model=cfg.model), run / "export").model.tokenizer_path == \
        str(run / "export" / "tokenizer.model")

    # resume to step 4: the init checkpoint is gone and the recipe now says dataset; the run keeps what it started with
    before = (run / "checkpoints" / "normalization.json").read_text()
    run_ranks(loop_workers.train_job, 2, str(run), 4, 2,
              {"init_weights": str(tmp_path / "gone"), "model_options": {**options, "norm_stats": "dataset"}},
              timeout_s=300)
    assert (run / "checkpoints" / "step-4").is_dir()
    assert (run / "checkpoints" / "normalization.json").read_text() == before
    assert json.loads((run / "export" / "normalization.json").read_text())["offset"] == pytest.approx(offset)
    assert (run / "export" / "tokenizer.model").read_bytes() == tokenizer
    _side_files_are_hashed(run / "export")


def _side_files_are_hashed(export) -> None:
    """export.json records the hash of every file the policy's behaviour depends on (and that it has no
    tokenizer.json), so an evaluation refuses one changed afterwards."""
    from embodyhpc.checkpoint.integrity import sha256_file, verify_export

    recorded = verify_export(export)["side_files"]
    assert recorded == {**{name: sha256_file(export / name) for name in
                           ("normalization.json", "policy_io.json", "tokenizer.model")}, "tokenizer.json": None}
