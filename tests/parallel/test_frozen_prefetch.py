"""FSDP2 on 2 gloo ranks with GR00T's VLM frozen (its fine-tuning default): the frozen vision tower and LLM are
all-gathered once per step, in forward, and never in backward (no gradient reaches them: parallel/parallelize.py,
skip_frozen_prefetch); every unit that trains, or passes gradients on to one that does, is still gathered in
backward. Counted at FSDP2's all-gather, per unit, over two steps."""

from __future__ import annotations

import pytest

from tests.parallel import workers
from tests.parallel.harness import run_ranks

pytestmark = pytest.mark.slow  # 2 ranks x 4 sharded GR00Ts: ~10 s on this machine

VISION = ("backbone.vision.blocks.0", "backbone.vision.blocks.1")
LLM = ("backbone.embed_tokens", "backbone.layers.0", "backbone.layers.1")
LAST = "action_head.model.transformer_blocks.3"  # kept gathered from forward to backward (plan.py)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(workers.frozen_prefetch_scenario, 2, timeout_s=180)


@pytest.mark.parametrize(("tune", "no_backward"), [
    ("frozen", VISION + LLM), ("tune_llm", VISION),
    ("tune_visual", LLM[:1]),  # the frozen LLM layers pass gradients on to the vision tower; the token table does not
    ("trainable", ())])
def test_frozen_units_are_gathered_in_forward_only(ranks, tune: str, no_backward: tuple[str, ...]) -> None:
    for rank in ranks:
        result = rank[tune]
        units = result["units"]
        assert set(no_backward).isdisjoint(result["trained"])  # they are frozen
        for step in result["steps"]:
            # control: every unit and the root are gathered once in forward (the counter sees FSDP2's all-gathers)
            assert step["forward"] == sorted([*units, "<root>"])
            # in backward: every unit that trains or passes gradients on, once; the last one is still gathered
            assert step["backward"] == sorted(u for u in units if u not in no_backward and u != LAST)
