"""LIBERO end to end through the CLI on this machine (recipes/libero_cpu.yaml): random-policy episodes recorded
in the suite as a LeRobot dataset -> tiny pi0.5 on 2 processes -> LIBERO evaluation shards -> report.

The chain and the conventions are under test, not a success rate (a few steps of training on random episodes).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers import run_dir_from
from tests.launch.demo import embodyhpc

pytestmark = [pytest.mark.slow, pytest.mark.sim]
RECIPE = "recipes/libero_cpu.yaml"


def test_libero_dataset_train_and_evaluate(tmp_path):
    data = tmp_path / "libero-data"
    synth = ("data", "synth", "--env", "libero", "--tasks", "libero_spatial/0", "--episodes", "2",
             "--max-steps", "12", "--cameras", "image,image2", "--image-size", "32", "--option",
             "render_quality=fast", "--out", str(data))
    refused = embodyhpc(*synth[:-2], "--policy", "expert", "--out", str(tmp_path / "x"), ok=False)
    assert refused.returncode == 2 and "no scripted expert" in refused.stderr and "--policy random" in refused.stderr
    embodyhpc(*synth, "--policy", "random")
    info = json.loads((data / "meta" / "info.json").read_text())
    features = info["features"]
    assert features["observation.state"]["shape"] == [8] and features["action"]["shape"] == [7]
    assert features["observation.images.image"]["shape"][:2] == [32, 32]
    assert info["fps"] == 20 and info["total_episodes"] == 2 and info["total_frames"] == 24

    result = embodyhpc("submit", RECIPE, "--local", "--json", f"job.runs_root={tmp_path / 'runs'}",
                       f"data.root={data}", "train.steps=6", "checkpoint.every_steps=6", "train.warmup_steps=1",
                       "eval.max_steps=8")
    run_dir = run_dir_from(result.stdout)
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["outcome"] == "complete", report["why"]
    overall = {name: p["overall"] for name, p in report["results"]["policies"].items()}
    assert set(overall) == {"trained", "random", "replay"}
    assert all(o["recorded"] == o["planned"] == 2 for o in overall.values())
    io = json.loads((run_dir / "export" / "policy_io.json").read_text())
    assert io["cameras"] == ["image", "image2"] and io["action_dim"] == 7 and io["fps"] == 20
    records = [json.loads(line) for path in sorted((run_dir / "eval" / "shards").rglob("*.jsonl")) for line in
               path.read_text().splitlines()]
    trained = [r for r in records if r["policy"] == "trained"]
    assert {r["task"] for r in trained} == {"libero_spatial/0"} and all(r["length"] == 8 for r in trained)
    # the replay row: the recorded episodes (seed 0, episodes 0 and 1) from their own initial states, in step
    replayed = [r for r in records if r["policy"] == "replay"]
    assert len(replayed) == 2 and all(r["replay"]["matched"] == "initial state" for r in replayed)
    assert all(r["replay"]["max_state_error"] <= 1e-4 and r["replay"]["steps_replayed"] == 8 for r in replayed)
