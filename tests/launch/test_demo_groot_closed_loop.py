"""GR00T's closed loop through the CLI, as for pi0.5 (test_demo_closed_loop.py): expert demonstrations -> tiny GR00T
on 2 processes (FSDP2 over gloo) -> evaluation array on held-out goals -> report. The model goes in by its
plug-in alone: the same loop, parallelizer, checkpointer and evaluation.

The claim under test: the trained policy beats the random policy with non-overlapping Wilson 95% intervals, on the
recipe's own evaluation (10 held-out episodes per task, 40 per policy). Measured with this recipe (600 steps, 2
ranks, the DiT at width 192): trained 9/24 [0.21, 0.57] on 6 episodes per task (1000 steps: also 9/24) vs random
0/24 [0.00, 0.14], expert 24/24; the same 600-step policy on the recipe's 40 episodes: trained 16/40 [0.26, 0.55],
random 0/40 [0.00, 0.09], expert 40/40 (evaluation ~4 min, the chain ~12 min on 2 loaded cores); a later run of
the test: trained 10/40 [0.14, 0.40] (a margin of 0.05 over random: no room to train less), 1120 s at load 8-14
(training ~11 min, 0.53 s/step quiet; evaluation ~7.5 min, the trained policy's episodes ~75% of it). The
demonstrations are the pi0.5 demo's (tests/launch/demo.py), made once per test run. The same run checks what a
shorter chain once checked on its own: the metrics file, packing, and a GR00T export the evaluation read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helpers import run_dir_from
from tests.launch.demo import GROOT_DEMO, embodyhpc

pytestmark = [pytest.mark.slow, pytest.mark.sim]


def test_trained_groot_beats_random_with_non_overlapping_intervals(tmp_path, demo_data):
    result = embodyhpc("submit", GROOT_DEMO, "--local", "--json", f"job.runs_root={tmp_path / 'runs'}",
                       f"data.root={demo_data}")
    run_dir = run_dir_from(result.stdout)
    recipe = yaml.safe_load(Path(GROOT_DEMO).read_text())
    episodes = recipe["eval"]["episodes_per_task"] * len(recipe["eval"]["tasks"]) * len(recipe["eval"]["seeds"])
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete", report["why"]
    overall = {name: p["overall"] for name, p in report["results"]["policies"].items()}
    assert set(overall) == {"trained", "expert", "random"}
    assert all(o["recorded"] == o["planned"] == episodes for o in overall.values())
    assert overall["trained"]["ci_low"] > overall["random"]["ci_high"], overall
    assert report["checkpoint_step"] == recipe["train"]["steps"]
    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    every = recipe["train"]["log_every"]
    assert [m["step"] for m in metrics] == list(range(every, recipe["train"]["steps"] + 1, every))
    assert metrics[-1]["loss"] < metrics[0]["loss"] and all(0 < m["packing_efficiency"] <= 1 for m in metrics)
    from safetensors import safe_open

    with safe_open(str(run_dir / "export" / "model.safetensors"), "pt") as weights:
        assert "action_head.model.transformer_blocks.0.attn1.to_q.weight" in weights.keys()
    print(json.dumps(overall))
