"""The smoke row that resumes and evaluates a transformer-engine checkpoint (embodyhpc/train/smoke_chain.py), driven
on the CPU through the transformer-engine double standing for a GPU node (tests/doubles: TE 2.9's te.Linear with its
`_extra_state`): the same function the row runs after training on the first GPU node."""

from __future__ import annotations

import pytest
import torch

from embodyhpc.config.schema import PrecisionConfig
from embodyhpc.models import build_model
from embodyhpc.models.fp8 import FP8GemmCounter
from embodyhpc.train.loop import micro_batch_step
from embodyhpc.train.smoke import smoke_model
from embodyhpc.train.smoke_chain import resume_and_evaluate

DELAYED = PrecisionConfig(mode="fp8", fp8_backend="te", fp8_recipe="delayed")


@pytest.fixture
def te_gpu_node(monkeypatch):
    from tests.helpers import DOUBLES, TE_DOUBLE_CUDA, drop_modules

    monkeypatch.setenv(TE_DOUBLE_CUDA, "1")
    monkeypatch.syspath_prepend(str(DOUBLES))
    drop_modules("transformer_engine")
    yield
    drop_modules("transformer_engine")


@pytest.mark.parametrize("model_name", ["pi05", pytest.param("groot", marks=pytest.mark.slow)])
def test_the_row_resumes_the_fp8_state_and_evaluates_the_trained_weights(te_gpu_node, model_name) -> None:
    torch.set_num_threads(1)
    entry = smoke_model(model_name, "tiny")
    cfg = entry.config("tiny", "sdpa_reference")
    batch, noise, flow_time, _ = entry.fixed_batch(cfg, 0)

    def build():
        torch.manual_seed(0)
        model = build_model(cfg, DELAYED)
        model.init_weights(seed=0) if hasattr(model, "init_weights") else None
        return model

    def loss_of(model) -> float:
        with torch.no_grad():
            return float(model(batch, noise=noise, time=flow_time).loss)

    model = build()
    counter = FP8GemmCounter(model, "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        micro_batch_step(model, batch, DELAYED, noise=noise, time=flow_time)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert counter.take()[0] > 0
    result = resume_and_evaluate(model, optimizer, build, cfg, loss_of, step=2, device="cpu")
    assert result["ok"], result["reason"]
    assert result["te_layers"] == counter.num_layers > 0 and result["state_bytes"] > 100 * result["te_layers"]
    assert result["export_tensors"] == len([k for k in model.state_dict() if not k.endswith("_extra_state")])


def test_a_model_that_never_ran_in_fp8_fails_the_row(te_gpu_node) -> None:
    entry = smoke_model("pi05", "tiny")
    cfg = entry.config("tiny", "sdpa_reference")
    batch, noise, flow_time, _ = entry.fixed_batch(cfg, 0)
    torch.manual_seed(0)
    model = build_model(cfg, DELAYED)
    model.init_weights(seed=0)
    optimizer = torch.optim.AdamW(model.parameters())

    def loss_of(m) -> float:
        with torch.no_grad():
            return float(m(batch, noise=noise, time=flow_time).loss)

    result = resume_and_evaluate(model, optimizer, lambda: build_model(cfg, DELAYED), cfg, loss_of, step=1,
                                 device="cpu")
    assert not result["ok"] and "hold no FP8 state after training" in result["reason"]


@pytest.mark.slow
def test_the_smoke_row_trains_checkpoints_resumes_and_evaluates_in_its_own_process() -> None:
    """The row itself (run_row: FSDP2 on one gloo rank, the loop's step, then the chain), on the CPU with the
    transformer-engine double standing for a GPU node; what `embodyhpc smoke` runs on the first GPU node."""
    import json
    import subprocess
    import sys

    from tests.helpers import REPO_ROOT

    script = (
        "import json\n"
        "from tests.helpers import use_doubles\n"
        "use_doubles('transformer_engine', gpu_node=True)\n"
        "from embodyhpc.train.smoke import SmokePath, run_row\n"
        "path = SmokePath('te fp8 resume + eval', device='cpu', precision='fp8', fp8_backend='te',\n"
        "                 fp8_recipe='delayed', resume_and_evaluate=True)\n"
        "print(json.dumps(run_row(path, 6, 'tiny')))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["status"] == "passed", row["reason"]
    assert row["fp8_gemms"] > 0 and row["last_loss"] < row["first_loss"]
