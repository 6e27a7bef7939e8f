"""The plan, the refusals, and the parts of parallelize that need no process group (run in the pytest process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from embodyhpc.config.schema import ParallelismConfig, PrecisionConfig
from embodyhpc.models import build_model
from embodyhpc.parallel import build_mesh, declared_units, make_plan, materialize, mixed_precision_policy, parallelize
from embodyhpc.parallel.ac import apply_activation_checkpointing
from embodyhpc.parallel.precision import check_fp8_conversion
from tests.models.conftest import make_batch, make_samples
from tests.parallel.workers import FP8, MODEL

FP32, BF16 = PrecisionConfig(mode="fp32"), PrecisionConfig(mode="bf16")
BLOCKS = ("vision.blocks.0", "vision.blocks.1", "layers.0", "layers.1")


@pytest.fixture
def meta_model() -> nn.Module:
    with torch.device("meta"):
        return build_model(MODEL)


class Undeclared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))


class Declares(Undeclared):
    def __init__(self, units) -> None:
        super().__init__()
        self.units = units

    def fsdp_units(self) -> list[nn.Module]:
        return self.units(self)


def test_a_model_without_declared_units_is_refused() -> None:
    with pytest.raises(TypeError, match=r"Undeclared does not declare its FSDP wrap units: add a method `fsdp_units"):
        parallelize(Undeclared(), ParallelismConfig(), FP32, mesh=None)


@pytest.mark.parametrize(("units", "message"), [
    (lambda m: [m], "the model itself"),
    (lambda m: [nn.Linear(2, 2)], "not a submodule of the model"),
    (lambda m: [m.blocks[0], m.blocks[0]], "lists 'blocks.0' twice"),
    (lambda m: [], "returned no units"),
])
def test_declared_units_must_be_distinct_proper_submodules(units, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        declared_units(Declares(units))


def test_plan_for_each_activation_checkpointing_mode(meta_model) -> None:
    def plan(**kwargs):
        return make_plan(meta_model, ParallelismConfig(**kwargs), FP32, dp_replicate=1, dp_shard=2)

    none = plan()
    assert none.units == ("embed_tokens", *BLOCKS)  # declared order; the embedding is a leaf unit, not a block
    assert none.ac_units == () and none.compiled_units == ()
    assert plan(activation_checkpointing="full").ac_units == BLOCKS
    assert plan(activation_checkpointing="every_k", ac_every_k=2).ac_units == ("vision.blocks.1", "layers.1")
    assert plan(activation_checkpointing="every_k", ac_every_k=3).ac_units == ("layers.0",)
    assert plan(compile=True).compiled_units == BLOCKS
    assert none.unsharded_after_forward == ("layers.1", "<root>")


def test_dtype_policy_per_precision_mode(meta_model) -> None:
    assert mixed_precision_policy(FP32).param_dtype is None and mixed_precision_policy(FP32).reduce_dtype is None
    for mode in (BF16, FP8):  # fp8: what stays in high precision runs in bf16
        policy = mixed_precision_policy(mode)
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    plan = make_plan(meta_model, ParallelismConfig(), BF16, dp_replicate=1, dp_shard=2)
    assert (plan.param_dtype, plan.reduce_dtype, plan.fp8) == ("bfloat16", "float32", "off")


def test_summary_and_flat_params_for_logging(meta_model) -> None:
    plan = make_plan(meta_model, ParallelismConfig(dp_replicate=2, activation_checkpointing="full", compile=True),
                     BF16, dp_replicate=2, dp_shard=4)
    assert plan.summary() == ("HSDP dp_replicate=2 dp_shard=4; 5 units + root; AC full (4 units); compile 4 units; "
                              "params bfloat16, reduce float32, fp8 off")
    flat = plan.as_dict()
    assert flat["mode"] == "HSDP" and flat["ac_units"] == ",".join(BLOCKS) and flat["dp_shard"] == 4
    assert all(isinstance(value, (str, int)) for value in flat.values())


def test_checkpoint_wrapper_keeps_state_dict_keys_and_numerics() -> None:
    """Pins the private torch API ac.py relies on: the wrapper's location, unchanged state-dict keys (so
    checkpoints do not depend on the AC mode) and bit-identical loss and gradients."""
    torch.manual_seed(0)
    plain = build_model(MODEL)
    wrapped = build_model(MODEL)
    wrapped.load_state_dict(plain.state_dict())
    apply_activation_checkpointing(wrapped, ["vision.blocks.1", "layers.0"])
    assert type(wrapped.layers[0]).__name__ == "CheckpointWrapper"
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict())  # and loads a checkpoint written without AC
    batch = make_batch(MODEL, make_samples(2))
    noise, flow_time = torch.randn(2, 8, 8), torch.rand(2)
    losses = []
    for model in (plain, wrapped):
        loss = model(batch, noise=noise, time=flow_time).loss
        loss.backward()
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    grads = {name: p.grad for name, p in plain.named_parameters()}
    for name, param in wrapped.state_dict(keep_vars=True).items():
        assert torch.equal(param.grad, grads[name]) if grads[name] is not None else param.grad is None, name


def test_fp8_mode_refuses_a_model_without_fp8_layers(meta_model) -> None:
    with pytest.raises(ValueError, match="mode=fp8 with fp8_backend=torchao, but the model holds no fp8 layers"):
        check_fp8_conversion(meta_model, FP8)
    assert check_fp8_conversion(meta_model, BF16) == "off"


def test_build_mesh_takes_resolved_degrees_only() -> None:
    with pytest.raises(ValueError, match=r"resolved degrees .*dp_shard=-1.*resolve\(config\)"):
        build_mesh(1, -1, "cpu")


def test_materialize_refuses_a_model_without_init_weights() -> None:
    with torch.device("meta"):
        model = Undeclared()
    with pytest.raises(TypeError, match="Undeclared has no init_rules"):
        materialize(model, "cpu")
