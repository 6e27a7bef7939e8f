"""Per-block torch.compile (with full activation checkpointing, the torchtitan order) under FSDP2 on 2 ranks.

Slow: compiling the blocks takes ~20 s with a warm inductor cache (.cache/inductor) and ~95 s cold on 2 cores.
The graph-break and recompile counts use the aot_eager backend (what dynamo captures does not depend on the
backend that lowers it): every block is one graph over packed batches of any composition, with AC off and on.
"""

from __future__ import annotations

import pytest

from tests.parallel import workers
from tests.parallel.harness import run_ranks

pytestmark = pytest.mark.slow


def test_compiled_blocks_train_like_eager() -> None:
    ranks = run_ranks(workers.compile_scenario, 2, timeout_s=900)  # inductor compiles: minutes on a busy 2-core machine
    eager, compiled = ranks[0]["eager"], ranks[0]["compiled"]
    assert compiled["plan"].compiled_units == compiled["plan"].ac_units == eager["plan"].ac_units
    assert len(compiled["plan"].compiled_units) == 4
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=0, abs=1e-5)  # inductor fuses, sums differ


# issue 14's goal is <= 3 recompiles over 50 batches (bench/compile_blocks.py measures 0); over these 8 batches one
# at most: without the dynamic-size marks of parallel/dynamic_shapes.py the joint layers recompiled 2-3 times here
MAX_RECOMPILES = 1


@pytest.mark.parametrize("ac", ["none", "full"])
def test_compiled_blocks_have_no_graph_breaks_and_do_not_recompile_for_new_packings(ac: str) -> None:
    ranks = run_ranks(workers.compile_counts_scenario, 2, ac, 8, timeout_s=900)  # a cold inductor cache in CI
    for rank in ranks:
        report = rank["report"]
        assert set(report) == {"vision.blocks.0", "vision.blocks.1", "layers.0", "layers.1"}
        assert rank["breaks_total"] == 0
        for block, counts in report.items():
            assert counts["graphs"] >= 1 and counts["breaks"] == 0, (block, counts)
            assert counts["recompiles"] <= MAX_RECOMPILES, (block, counts)
