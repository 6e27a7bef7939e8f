"""The training loop with precision.fp8_backend=te, on 2 gloo ranks with the transformer-engine double
(tests/doubles: transformer-engine 2.9-2.18's te.Linear, autocast and distributed.checkpoint).

Every te.Linear forward of training must run inside te.autocast (each micro-batch in its own region), including
the recomputation under activation checkpointing in backward (te.distributed.checkpoint re-enters the forward's
FP8 context; torch's checkpoint would recompute in bf16), and each logged step says how many GEMMs ran in FP8.
"""

from __future__ import annotations

import pytest

from tests.parallel.harness import run_ranks
from tests.train import workers

STEPS, MICRO_BATCHES = 2, 2  # tests/train/workers.recipe: global batch 8 = 2 ranks x 2 micro-batches x 2


@pytest.mark.parametrize(("ac", "recipe_name", "forwards_per_micro_batch"),
                         # 2.4-2.6 s alone: two rank processes; the fast loop checks the step's fp8 region itself
                         # (tests/models/test_te_strict.py drives micro_batch_step through the TE double)
                         [pytest.param("none", "current", 1, marks=pytest.mark.slow),
                          pytest.param("full", "delayed", 2, marks=pytest.mark.slow)])
def test_every_te_forward_runs_in_fp8_and_the_step_logs_the_count(tmp_path, ac, recipe_name,
                                                                  forwards_per_micro_batch) -> None:
    ranks = run_ranks(workers.te_train_job, 2, str(tmp_path), STEPS, ac, recipe_name, timeout_s=240)
    for rank in ranks:
        layers = rank["num_layers"]
        assert rank["forwards"]["high_precision"] == 0, rank["forwards"]
        # each layer once per micro-batch in forward, and again in backward's recompute under full AC
        assert rank["forwards"]["fp8"] == layers * STEPS * MICRO_BATCHES * forwards_per_micro_batch
        metrics = rank["last_metrics"]
        assert metrics["fp8_gemms"] == layers * MICRO_BATCHES * forwards_per_micro_batch
        assert metrics["fp8_gemms_fell_back"] == 0
