"""parallelism.cuda_graphs: refused at validate time where CUDA graphs cannot pay (FSDP2 training), one line naming
the key, every reason that applies and the fix; every shipped recipe stays valid."""

from __future__ import annotations

import pytest
import torch

from embodyhpc.config.load import shipped_recipes
from embodyhpc.config.schema import ParallelismConfig, PrecisionConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_model
from embodyhpc.parallel import make_plan
from embodyhpc.validation import load_recipe
from tests.parallel.workers import MODEL

NEEDS = ["data.root=/data/set", "site.account=robotics", "model.tokenizer_path=/models/paligemma/tokenizer.model"]
FSDP_REASON = "FSDP2 frees each compiled block's gathered parameters"
PACKING_REASON = "model.packing changes the blocks' input shapes"
FP8_REASON = "the fp8 GEMM counter adds in place"


def refusal(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        load_recipe("pi05_bf16", [*NEEDS, "parallelism.compile=true", "parallelism.cuda_graphs=true", *overrides],
                    site="example_ib")
    return caught.value


@pytest.mark.parametrize(("overrides", "present", "absent"), [
    ((), (FSDP_REASON, PACKING_REASON), (FP8_REASON,)),  # the recipe packs (model.packing: true)
    (("model.packing=false",), (FSDP_REASON,), (PACKING_REASON, FP8_REASON)),  # fixed shapes: FSDP2 still frees
    (("precision.mode=fp8", "precision.fp8_backend=torchao"), (FSDP_REASON, PACKING_REASON, FP8_REASON), ()),
    # dp_shard=1: still FSDP2 units, which free their gathered parameters after backward
    (("parallelism.dp_replicate=32", "parallelism.dp_shard=1", "model.packing=false"), (FSDP_REASON,), ()),
])
def test_cuda_graphs_are_refused_with_every_reason_that_applies(overrides, present, absent) -> None:
    error = refusal(*overrides)
    assert error.key == "parallelism.cuda_graphs" and "set parallelism.cuda_graphs=false" in error.fix
    text = str(error)
    assert "\n" not in text and "parallelism.cuda_graphs: CUDA graphs cannot pay here: " in text
    for reason in present:
        assert reason in text, reason
    for reason in absent:
        assert reason not in text, reason


def test_the_cli_refuses_it_on_one_line_with_exit_2(cli) -> None:
    result = cli("validate", "pi05_bf16", *NEEDS, "parallelism.cuda_graphs=true", "--site", "example_ib")
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1 and result.out == ""
    assert "parallelism.cuda_graphs" in lines[0] and "CUDA graphs cannot pay here" in lines[0]
    assert "fix: set parallelism.cuda_graphs=false" in lines[0]


def test_without_gpus_the_gpu_refusal_comes_first() -> None:
    with pytest.raises(ConfigError, match="CUDA graphs need GPUs"):
        load_recipe("smoke_cpu", ["parallelism.compile=true", "parallelism.cuda_graphs=true"])


def test_every_shipped_recipe_stays_valid() -> None:
    for recipe in shipped_recipes():
        overrides = [*NEEDS, "model.init_weights=/models/pi05_base"]
        loaded = load_recipe(recipe, overrides, site="example_ib")
        assert loaded.config.parallelism.cuda_graphs is False, recipe


def test_the_refusals_premise_holds_in_the_plan() -> None:
    """What the refusal says of FSDP2 training, read from parallel/plan.py instead of restated: every compiled block
    is an FSDP2 unit, and all but the last are resharded after forward, on any dp_shard. A knob that keeps units
    gathered would fail this test: then the refusal must learn where cuda_graphs can pay."""
    with torch.device("meta"):
        model = build_model(MODEL)
    for dp_shard in (1, 2):
        plan = make_plan(model, ParallelismConfig(compile=True, cuda_graphs=True), PrecisionConfig(mode="bf16"),
                         dp_replicate=1, dp_shard=dp_shard)
        assert len(plan.compiled_units) > 1 and set(plan.compiled_units) <= set(plan.units)
        resharded = [unit for unit in plan.compiled_units if unit not in plan.unsharded_after_forward]
        assert resharded == list(plan.compiled_units[:-1])
