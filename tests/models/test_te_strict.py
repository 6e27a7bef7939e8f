"""The transformer-engine double is as strict as transformer-engine 2.9 where embodyhpc's paths meet it
(tests/doubles/transformer_engine: constructor and forward need CUDA, `_extra_state` grows once a layer ran in FP8,
te.Linear.forward and te.distributed.checkpoint disable dynamo, a backward inside an enabled te.autocast region is
refused where TE documents it as unsupported and computes on silently), and the code around it copes: the training
step runs its backward after the region exits, a checkpoint of a
layer that trained in FP8 loads into a freshly built one, an export holds weights only, inference and fit checks
never build a te layer, and compile with transformer-engine is refused because it would compile nothing.
The whole chain on 2 ranks (train -> async checkpoint -> resume on 1 rank -> export -> evaluate on a node without
CUDA) is tests/train/test_te_chain.py."""

from __future__ import annotations

import pickle
import types
import warnings

import pytest
import torch
from torch import nn

from embodyhpc.checkpoint import Checkpointer
from embodyhpc.checkpoint.export import check_fits, consolidated_model_state, model_entries
from embodyhpc.config.schema import CheckpointConfig, PrecisionConfig
from embodyhpc.models import build_model
from embodyhpc.models.fp8 import fp8_autocast
from embodyhpc.train.loop import micro_batch_step
from embodyhpc.validation import load_recipe
from tests.helpers import one_line_error

DELAYED = PrecisionConfig(mode="fp8", fp8_backend="te", fp8_recipe="delayed")


def _te():
    import transformer_engine.pytorch as te

    return te


class TwoLayers(nn.Module):
    def __init__(self, te) -> None:
        super().__init__()
        self.first = te.Linear(16, 32, device="cpu")  # the stand-in node's "GPU" memory
        self.second = te.Linear(32, 16, device="cpu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def test_on_a_node_without_cuda_te_refuses_to_build_or_run_a_layer(te_double, monkeypatch) -> None:
    import transformer_engine.pytorch as te

    layer = te.Linear(16, 16, device="cpu")  # built where a GPU is (the fixture's stand-in)
    from tests.helpers import TE_DOUBLE_CUDA

    monkeypatch.delenv(TE_DOUBLE_CUDA)
    with pytest.raises(AssertionError, match="TransformerEngine needs CUDA"):
        te.Linear(16, 16, device="cpu")
    with pytest.raises(AssertionError, match="TransformerEngine needs CUDA"):
        layer(torch.randn(8, 16))  # a CPU tensor is not a CUDA one


def test_a_backward_inside_an_fp8_region_is_refused_and_one_after_it_runs(te_double) -> None:
    """TE's contract (the double's quantization.py doc): backward after the region exits. The refusal comes from the
    backward itself, whatever the layers ran in; a backward after nested regions, after a disabled region, and
    te.checkpoint's recompute (which re-enters the region inside a backward that runs outside it) are all fine."""
    te = _te()
    torch.manual_seed(0)
    model = TwoLayers(te)
    x = torch.randn(8, 16)
    with fp8_autocast(DELAYED):
        loss = model(x).sum()
        with pytest.raises(AssertionError, match="backward ran inside te.autocast"):
            loss.backward(retain_graph=True)
        with te.autocast(enabled=False):  # a disabled region nested in an enabled one: still inside
            with pytest.raises(AssertionError, match="backward ran inside te.autocast"):
                loss.backward(retain_graph=True)
    assert model.first.weight.grad is None
    loss.backward()
    assert model.first.weight.grad.abs().sum() > 0
    with te.autocast(enabled=False):
        model(x).sum().backward()  # no FP8 region open: nothing to reduce at its exit
    with fp8_autocast(DELAYED), fp8_autocast(DELAYED):
        loss = te.checkpoint(model, x, use_reentrant=False).sum()
    loss.backward()  # the recompute enters the region in backward; the layers' backward runs after it left
    assert (model.first.fp8_forwards, model.first.high_precision_forwards) == (3, 1)


class _LossModel(nn.Module):
    """A model as the loop calls it: model(batch) -> an object with .loss."""

    def __init__(self, te) -> None:
        super().__init__()
        self.body = TwoLayers(te)

    def forward(self, batch: torch.Tensor) -> types.SimpleNamespace:
        return types.SimpleNamespace(loss=self.body(batch).square().mean())


def test_the_training_step_runs_the_backward_after_the_fp8_region_exits(te_double) -> None:
    """embodyhpc.train.loop.micro_batch_step (what the loop and `embodyhpc smoke` train through): the forward in
    te.autocast, the backward after it; moved inside, the double refuses as TE's contract does."""
    torch.manual_seed(0)
    model = _LossModel(_te())
    batch = torch.randn(8, 16)
    loss = micro_batch_step(model, batch, DELAYED, loss_scale=0.5)
    layers = (model.body.first, model.body.second)
    assert [(m.fp8_forwards, m.high_precision_forwards) for m in layers] == [(1, 0), (1, 0)]
    assert not loss.requires_grad and torch.isfinite(loss)
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in layers)


def test_extra_state_is_empty_until_the_layer_runs_in_fp8_and_a_payload_after(te_double) -> None:
    torch.manual_seed(0)
    model = TwoLayers(_te())
    x = torch.randn(8, 16)
    assert model.first.get_extra_state().numel() == 0
    model(x)  # outside autocast: no FP8, nothing to keep
    assert model.first.get_extra_state().numel() == 0
    with fp8_autocast(DELAYED):
        model(x)
    payload = model.first.get_extra_state()
    assert payload.dtype == torch.uint8 and payload.numel() > 100
    state = pickle.loads(payload.numpy().tobytes())
    assert torch.equal(state["amax_history_fwd"][0, 0], x.abs().amax())  # this forward's input amax
    model(x)  # a later forward outside autocast empties it again, as TE's fp8_checkpoint flag does
    assert model.first.get_extra_state().numel() == 0


def test_a_checkpoint_of_layers_that_ran_in_fp8_loads_into_fresh_ones_and_exports_weights_only(te_double,
                                                                                                tmp_path) -> None:
    torch.manual_seed(0)
    trained = TwoLayers(_te())
    optimizer = torch.optim.AdamW(trained.parameters())
    with fp8_autocast(DELAYED):
        loss = trained(torch.randn(8, 16)).sum()
    loss.backward()
    optimizer.step()
    saved = {name: pickle.loads(m.get_extra_state().numpy().tobytes()) for name, m in trained.named_children()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        with Checkpointer(tmp_path, CheckpointConfig(every_steps=1)) as ckpt:
            ckpt.save(1, trained, optimizer, blocking=True)
        fresh = TwoLayers(_te())
        assert fresh.first.get_extra_state().numel() == 0
        with Checkpointer(tmp_path, CheckpointConfig(every_steps=1)) as ckpt:
            ckpt.load(1, fresh, torch.optim.AdamW(fresh.parameters()))
        for name, module in fresh.named_children():
            loaded = pickle.loads(module.get_extra_state().numpy().tobytes())
            for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
                assert torch.equal(loaded[key], saved[name][key]), (name, key)
            assert torch.equal(module.weight, getattr(trained, name).weight)
        weights = consolidated_model_state(tmp_path / "step-1")
    assert sorted(weights) == sorted(model_entries(tmp_path / "step-1")) == [
        "first.bias", "first.weight", "second.bias", "second.weight"]


def test_fit_checks_and_inference_builds_never_build_a_te_layer(te_double_without_gpu) -> None:
    """On a node without CUDA, where te.Linear cannot be built, an fp8 recipe's weights are still checked against
    the model and loaded by the evaluation: both build the model without fp8 layers."""
    loaded = load_recipe("demo_metaworld_cpu")
    model_cfg = loaded.config.model
    with pytest.raises(AssertionError, match="TransformerEngine needs CUDA"):
        build_model(model_cfg, PrecisionConfig(mode="fp8", fp8_backend="te", fp8_recipe="current"))
    with torch.device("meta"):
        reference = build_model(model_cfg)
    entries = {k: (v.dtype, v.shape) for k, v in reference.state_dict().items()}
    model = check_fits(entries, model_cfg, where="w", built_with="r")
    assert not [m for m in model.modules() if type(m).__module__.startswith("transformer_engine")]


@pytest.mark.slow  # three compiles: over the fast loop's budget
def test_compile_with_transformer_engine_would_compile_nothing(te_double) -> None:
    """te.distributed.checkpoint is @torch._disable_dynamo and te.Linear.forward @no_torch_dynamo (TE 2.9
    distributed.py:621, module/linear.py:1370): an activation-checkpointed block compiles no graph at all."""
    import transformer_engine.pytorch as te

    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def linears(graph_module) -> int:
        return sum(node.target is torch._C._nn.linear for node in graph_module.graph.nodes)

    def compile_and_run(function) -> None:
        graphs.clear()
        torch._dynamo.reset()
        with fp8_autocast(DELAYED):
            loss = torch.compile(function, backend=counting)(torch.randn(8, 16, requires_grad=True)).sum()
        loss.backward()
        torch._dynamo.reset()

    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    compile_and_run(plain)  # the control: the same block of torch layers compiles, GEMMs included
    assert sum(linears(graph) for graph in graphs) == 2
    block = TwoLayers(te)
    compile_and_run(block)  # every te.Linear is a graph break: no GEMM is ever in a graph
    assert sum(linears(graph) for graph in graphs) == 0
    compile_and_run(lambda x: te.checkpoint(block, x, use_reentrant=False))  # activation-checkpointed: no graph
    assert graphs == []


def test_compile_with_transformer_engine_is_refused_in_one_line(cli) -> None:
    args = ["validate", "pi05_fp8", "--site", "example_ib", "data.root=/d", "site.account=a",
            "model.tokenizer_path=/t/tokenizer.model"]
    assert cli(*args).code == 0  # the shipped recipe leaves compile off
    one_line_error(cli(*args, "parallelism.compile=true"), "parallelism.compile", "transformer-engine",
                   "fp8_backend=torchao")
