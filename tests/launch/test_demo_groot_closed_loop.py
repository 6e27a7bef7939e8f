"""GR00T's closed loop through the CLI, as for pi0.5 (test_demo_closed_loop.py): expert demonstrations -> tiny GR00T
on 2 processes (FSDP2 over gloo) -> evaluation array on held-out goals -> report. The model goes in by its
plug-in alone: the same loop, parallelizer, checkpointer and evaluation.

The claim under test: the trained policy beats the random policy with non-overlapping Wilson 95% intervals, on the
recipe's own evaluation but for fewer episodes (GROOT_EPISODES_PER_TASK = 6 per task, 24 per policy, in 2 shards, as
the pi0.5 demo's test). With the recipe as it is (600 steps at lr 3e-4, the dense-mask attention), 10 episodes per
task gave trained 22/40 [0.40, 0.69] vs random 0/40 [0.00, 0.09], expert 40/40 (reach 2, button-press 10,
drawer-open 9, door-open 1 of 10), in every run measured (training is deterministic: the same losses to the last
digit under any load); the same run's first 6 episodes per task (each episode's seed depends on its index alone):
trained 13/24 [0.35, 0.72] vs random 0/24 [0.00, 0.14], and 332 s of episode time instead of 526 s in that CI. With
400 steps instead of 600 (tried to save time): 7/24 [0.15, 0.49], too close to random's 0.14 to keep. Before (lr
1e-3, "auto" attention, which picks a per-segment kernel 3x slower on a CPU) the chain reached 10-16/40. An
untrained policy (2 steps) fails the claim: 0/40.
The demonstrations are the pi0.5 demo's (tests/launch/demo.py), made once per test run. The same run checks what a
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

GROOT_EPISODES_PER_TASK = 6


def test_trained_groot_beats_random_with_non_overlapping_intervals(tmp_path, demo_data):
    result = embodyhpc("submit", GROOT_DEMO, "--local", "--json", f"job.runs_root={tmp_path / 'runs'}",
                       f"data.root={demo_data}", f"eval.episodes_per_task={GROOT_EPISODES_PER_TASK}", "eval.shards=2")
    run_dir = run_dir_from(result.stdout)
    recipe = yaml.safe_load(Path(GROOT_DEMO).read_text())
    episodes = GROOT_EPISODES_PER_TASK * len(recipe["eval"]["tasks"]) * len(recipe["eval"]["seeds"])
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
