"""The fp8 recipe on transformer-engine from training to an acting policy, on the CPU through the transformer-engine
double (tests/doubles: transformer-engine 2.9's te.Linear, as strict as the library on CUDA, `_extra_state` and
dynamo): train on 2 gloo ranks standing for GPU nodes, with delayed scaling and async checkpoints -> resume in a
fresh process on 1 rank -> export -> fit check -> the evaluation's policy loads and acts in a process standing for a
node without CUDA, where transformer-engine refuses to build a layer.

What the library does that a kinder double hid: a te.Linear's extra state is empty until it has run in FP8 and a
pickled payload after, so a fresh model asks DCP for 0 bytes where the checkpoint saved hundreds (DCP refuses the
size difference on every rank); an export that copied it into model.safetensors no longer fits the model; and an
evaluation or export that rebuilt the training precision's layers would need a GPU to build them.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors import safe_open

from embodyhpc.checkpoint.export import export_consolidated, load_checked_export
from tests.helpers import DOUBLES, REPO_ROOT
from tests.parallel.harness import run_ranks
from tests.train import workers

pytestmark = pytest.mark.slow


def saved_extra_state(folder) -> dict[str, bytes]:
    """Every `_extra_state` entry of a DCP step folder, read by torch's own converter (dcp_to_torch_save), not by
    embodyhpc's loader."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(folder, flat)
    state = torch.load(flat, weights_only=False)["model"]
    return {key.removesuffix("._extra_state"): bytes(value.numpy().tobytes())
            for key, value in state.items() if key.endswith("._extra_state")}


def scaling_state(payload: bytes) -> dict:
    state = pickle.loads(payload)
    return {"recipe": type(state["recipe"]).__name__,
            **{key: state[key] for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")}}


def test_an_fp8_run_on_transformer_engine_resumes_exports_and_evaluates(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(DOUBLES))  # this process unpickles TE's payloads (their recipe class)
    run = tmp_path / "run"
    first = run_ranks(workers.te_chain_job, 2, str(run), 2, timeout_s=240)
    assert first[0]["start_step"] == 0 and first[0]["final_step"] == 2
    step2 = run / "checkpoints" / "step-2"
    saved = saved_extra_state(step2)
    assert saved and all(len(payload) > 100 for payload in saved.values()), {k: len(v) for k, v in saved.items()}

    # a fresh process on another world size resumes: every te.Linear gets back the scaling state that was saved
    [resumed] = run_ranks(workers.te_chain_job, 1, str(run), 3, timeout_s=240)
    assert resumed["start_step"] == 2 and resumed["final_step"] == 3
    loaded = resumed["loaded_extra_state"]
    assert loaded.keys() == saved.keys()
    for name, payload in saved.items():
        want, got = scaling_state(payload), scaling_state(loaded[name])
        assert got["recipe"] == want["recipe"] == "DelayedScaling"
        for key in ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd"):
            assert torch.equal(got[key], want[key]), (name, key)
        assert want["amax_history_fwd"].abs().sum() > 0, name  # it holds what training measured
    metrics = resumed["last_metrics"]
    assert metrics["fp8_gemms"] > 0 and metrics["fp8_gemms_fell_back"] == 0
    assert torch.isfinite(torch.tensor(metrics["loss"]))

    # the export holds the weights only, and they fit the model the recipe builds for inference
    export = tmp_path / "export"
    export_consolidated(run / "checkpoints" / "step-2", export, config_yaml=workers.te_recipe_yaml())
    with safe_open(str(export / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert not [name for name in names if name.endswith("_extra_state")]
    assert {f"{layer}.weight" for layer in saved} <= names
    _, _, config, _ = load_checked_export(export)
    assert (config.precision.mode, config.precision.fp8_backend) == ("fp8", "te")

    # an evaluation shard's process on a node without CUDA, where transformer-engine is installed (the double)
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        from tests.helpers import use_doubles
        use_doubles("transformer_engine")  # installed, on a node without CUDA
        import transformer_engine.pytorch as te
        try:
            te.Linear(16, 16)
            refused = None
        except AssertionError as exc:
            refused = str(exc)
        from embodyhpc.eval.trained import load_trained_policy
        policy = load_trained_policy({str(export)!r}, execute_steps=2, denoise_steps=2)
        policy.reset("pick", 0)
        rng = np.random.default_rng(0)
        obs = {{"observation.state": rng.random(6, dtype=np.float32), "task": "pick up the cup",
               **{{f"observation.images.{{c}}": rng.integers(0, 255, (48, 48, 3), dtype=np.uint8)
                  for c in ("top", "wrist")}}}}
        action = policy.act(obs)
        print(json.dumps({{"refused": refused, "action": np.asarray(action).tolist(), "step": policy.step,
                          "te_layers": sum(type(m).__module__.startswith("transformer_engine")
                                           for m in policy.model.modules())}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=240, env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["refused"] == "TransformerEngine needs CUDA."
    assert result["te_layers"] == 0 and result["step"] == 2
    assert len(result["action"]) > 0 and all(abs(a) < 1e6 for a in result["action"])
