"""Per-block torch.compile (with full activation checkpointing, the torchtitan order) under FSDP2 on 2 ranks.

Slow: compiling the blocks takes ~20 s with a warm inductor cache (.cache/inductor) and ~95 s cold on 2 cores.
"""

from __future__ import annotations

import pytest

from tests.parallel import workers
from tests.parallel.harness import run_ranks

pytestmark = pytest.mark.slow


def test_compiled_blocks_train_like_eager() -> None:
    ranks = run_ranks(workers.compile_scenario, 2, timeout_s=420)
    eager, compiled = ranks[0]["eager"], ranks[0]["compiled"]
    assert compiled["plan"].compiled_units == compiled["plan"].ac_units == eager["plan"].ac_units
    assert len(compiled["plan"].compiled_units) == 4
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=0, abs=1e-5)  # inductor fuses, sums differ
