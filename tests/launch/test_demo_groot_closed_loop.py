"""GR00T's closed loop through the CLI, as for pi0.5 (test_demo_closed_loop.py): expert demonstrations -> tiny GR00T
on 2 processes (FSDP2 over gloo) -> evaluation array on held-out goals -> report. The model goes in by its
plug-in alone: the same loop, parallelizer, checkpointer and evaluation.

The claim under test: the trained policy beats the random policy with non-overlapping Wilson 95% intervals.
Not met yet: the one run measured (this recipe, 600 steps, 2 ranks) gave trained 2/24 [0.02, 0.26] (reach-v3 2/6,
the other tasks 0/6) vs random 0/24 [0.00, 0.14], expert 24/24; the intervals overlap. Marked xfail until the demo
recipe is tuned (candidates: execute_steps, steps, an unfrozen tiny VLM).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import run_dir_from
from tests.launch.test_demo_closed_loop import TASKS

DEMO = "recipes/demo_groot_metaworld_cpu.yaml"

pytestmark = pytest.mark.slow


def embodyhpc(*args: str) -> subprocess.CompletedProcess:
    """The installed command line in its own process (up to an hour: the chain took 25 min on a loaded machine)."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    result = subprocess.run([sys.executable, "-m", "embodyhpc.cli.main", *args], capture_output=True, text=True,
                            env=env, timeout=3600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.xfail(reason="measured trained 2/24 vs random 0/24: overlapping intervals; demo recipe not tuned yet",
                   strict=False)
def test_trained_groot_beats_random_with_non_overlapping_intervals(tmp_path):
    data = tmp_path / "demos"
    embodyhpc("data", "synth", "--out", str(data), "--tasks", TASKS, "--episodes", "20", "--image-size", "32",
              "--workers", "2")
    result = embodyhpc("submit", DEMO, "--local", "--json", f"job.runs_root={tmp_path / 'runs'}", f"data.root={data}",
                       "eval.episodes_per_task=6", "eval.shards=2")
    run_dir = run_dir_from(result.stdout)
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete", report["why"]
    overall = {name: p["overall"] for name, p in report["results"]["policies"].items()}
    assert set(overall) == {"trained", "expert", "random"}
    assert all(o["recorded"] == o["planned"] == 24 for o in overall.values())
    assert overall["trained"]["ci_low"] > overall["random"]["ci_high"], overall
    assert report["checkpoint_step"] == 600
    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < metrics[0]["loss"] and all(0 < m["packing_efficiency"] <= 1 for m in metrics)
    from safetensors import safe_open

    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as weights:
        assert "action_head.model.transformer_blocks.0.attn1.to_q.weight" in weights.keys()
    print(json.dumps(overall))
