"""The pi0.5 demo fine-tuned with LoRA from the demo's own export, through the CLI: `submit --local` with model.lora and
model.init_weights=<the demo run's export> (the base frozen, adapters trained on 2 FSDP2 gloo ranks), the merged
export evaluated on the demo's held-out episodes beside the random policy.

The claim: the LoRA fine-tuned policy beats random with non-overlapping Wilson 95% intervals. Built on the demo run
the closed-loop tests share (tests/conftest.py pi05_demo_run); its own cost is 30 training steps and one evaluation.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import run_dir_from
from tests.launch.demo import PI05_DEMO, PI05_EPISODES_PER_TASK, embodyhpc

pytestmark = [pytest.mark.slow, pytest.mark.sim, pytest.mark.xdist_group("pi05-demo")]


def test_the_demo_fine_tuned_with_lora_from_its_export_beats_random(pi05_demo_run, demo_data, tmp_path):
    export = pi05_demo_run / "export"
    result = embodyhpc("submit", PI05_DEMO, "--local", "--json", f"job.runs_root={tmp_path / 'runs'}",
                       f"data.root={demo_data}", f"model.init_weights={export}", "model.lora.rank=8",
                       "train.steps=30", "train.warmup_steps=5", "train.log_every=10", "checkpoint.every_steps=30",
                       "eval.every_k_checkpoints=0", f"eval.episodes_per_task={PI05_EPISODES_PER_TASK}",
                       "eval.shards=2", "eval.reference_policies=[random]")
    run_dir = run_dir_from(result.stdout)
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete", report["why"]
    overall = {name: p["overall"] for name, p in report["results"]["policies"].items()}
    assert overall["trained"]["ci_low"] > overall["random"]["ci_high"], overall
    # what was evaluated is the merged export: a plain model, its adapters folded in
    summary = json.loads((run_dir / "export" / "export.json").read_text())
    assert summary["lora_merged"]["layers"] > 0 and summary["lora_merged"]["scale"] == 1.0
    assert "lora" not in yaml.safe_load((run_dir / "export" / "config.yaml").read_text())["model"]
    assert not any(name.endswith((".lora_A", ".lora_B")) for name in summary["tensors"])
