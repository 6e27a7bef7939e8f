"""torchao fp8 under FSDP2 on 2 gloo ranks: the fp8 layers' weights are all-gathered in float8, training runs 2
steps (with scales precomputed in one all-reduce after the first) and stays near bf16 on the same data."""

from __future__ import annotations

import pytest

from tests.helpers import require
from tests.parallel import workers
from tests.parallel.harness import run_ranks

require("torchao", "fp8")

# the first losses come from identical weights: float8 rounding of the matmul inputs moves them ~1%
# (tests/models/test_fp8.py measured 0.3-1.4% per step on this model)
LOSS_RTOL = 0.05


@pytest.mark.slow
def test_fp8_trains_with_float8_all_gather() -> None:
    ranks = run_ranks(workers.fp8_scenario, 2)
    result = ranks[0]
    assert result["plan"].fp8 == "torchao" and result["plan"].param_dtype == "bfloat16"
    # the weight a converted layer sees in forward is what FSDP all-gathered: float8 data with its scale
    assert result["gathered_weight_types"] == ["Float8TrainingTensor", "Float8TrainingTensor"]
    assert all(rank["losses"] == result["losses"] for rank in ranks)
    assert result["losses"] == pytest.approx(result["bf16_losses"], rel=LOSS_RTOL)
    for rank in ranks:  # an fp8 layer and a high-precision one were trained on every rank
        assert {"layers.0.vlm.q_proj.weight", "action_out.weight"} <= set(rank["changed"])
