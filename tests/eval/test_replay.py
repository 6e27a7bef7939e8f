"""The "replay" reference row (embodyhpc/eval/replay.py) in the real LIBERO simulator: episodes recorded here with
the recorder replay to the same outcomes and the same states; a dataset with a flipped gripper sign, or with the
actions of another initial state, is reported as diverging; the gripper sign can be read off the data alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embodyhpc.eval.replay import STATE_TOLERANCE, ReplayDataset, ReplayPolicy, gripper_sign
from embodyhpc.eval.shards import Episode
from tests.helpers import require

pytestmark = pytest.mark.sim  # steps a simulator

TASK = "libero_spatial/0"
STEPS = 10


def _rewrite(src: Path, dest: Path, *, flip_gripper: bool = False, swap_episodes: bool = False) -> Path:
    """A copy of a recorded dataset with one convention made wrong."""
    shutil.copytree(src, dest)
    if flip_gripper:
        for path in (dest / "data").glob("chunk-*/file-*.parquet"):
            table = pq.read_table(path)
            actions = np.asarray(table.column("action").to_pylist(), dtype=np.float32)
            actions[:, -1] *= -1
            column = pa.array(actions.tolist(), type=table.schema.field("action").type)
            pq.write_table(table.set_column(table.column_names.index("action"), "action", column), path)
    if swap_episodes:  # each episode's actions now claim the other's initial state
        for path in (dest / "meta" / "episodes").glob("chunk-*/file-*.parquet"):
            table = pq.read_table(path)
            swapped = pa.array(list(reversed(table.column("env_episode").to_pylist())),
                               type=table.schema.field("env_episode").type)
            pq.write_table(table.set_column(table.column_names.index("env_episode"), "env_episode", swapped), path)
    return dest


def _replay(suite, root, episodes, out):
    from embodyhpc.eval.rollout import run_shard

    run_shard(suite, episodes, ReplayPolicy(suite, root), out, policy_name="replay", max_steps=STEPS)
    return [json.loads(line) for line in Path(out).read_text().splitlines()]


@pytest.mark.slow
def test_replay_reproduces_recorded_episodes_and_reports_wrong_conventions(tmp_path, capsys):
    require("libero.libero", "libero")
    from embodyhpc.eval.policies import RandomPolicy
    from embodyhpc.eval.record import record_episodes
    from embodyhpc.eval.references import make_reference_policies
    from embodyhpc.eval.suites import make_suite

    recorded = tmp_path / "recorded"
    episodes = [Episode(TASK, 0, 0), Episode(TASK, 0, 1)]
    with make_suite("libero", [TASK], render_quality="fast", replay_dataset=str(recorded)) as suite:
        record_episodes(suite, episodes, RandomPolicy(suite), recorded, max_steps=STEPS)
        # the registry builds the row from the suite's option
        assert list(make_reference_policies(["random", "replay"], suite)) == ["random", "replay"]
        dataset = ReplayDataset(recorded)
        outcomes = {e.env_triple[2]: e.success for e in dataset.episodes}

        same = _replay(suite, recorded, episodes, tmp_path / "same.jsonl")
        for record in same:  # same initial state + same actions: the same outcome and the same states
            assert record["replay"]["matched"] == "initial state" and record["length"] == STEPS
            assert record["success"] == outcomes[record["episode"]] == record["replay"]["recorded_success"]
            assert record["replay"]["max_state_error"] <= STATE_TOLERANCE
        assert "diverges" not in capsys.readouterr().out

        wrong = {"gripper sign flipped": _rewrite(recorded, tmp_path / "flipped", flip_gripper=True),
                 "another initial state": _rewrite(recorded, tmp_path / "swapped", swap_episodes=True)}
        for name, root in wrong.items():
            (record,) = _replay(suite, root, episodes[:1], tmp_path / f"{root.name}.jsonl")
            assert record["replay"]["max_state_error"] > 100 * STATE_TOLERANCE, name
            assert "diverges from the recorded states" in capsys.readouterr().out, name

    # the env closes the gripper on +1 (the fingers move towards 0): the recorded data say so, the flipped copy not
    assert gripper_sign(dataset) < 0 < gripper_sign(ReplayDataset(wrong["gripper sign flipped"]))


def test_episodes_match_by_initial_state_else_by_instruction(tmp_path):
    """Without the recorder's env triple (LeRobot's LIBERO datasets), an episode replays one of its instruction's."""
    from embodyhpc.data.writer import LeRobotWriter
    from embodyhpc.eval.suites import episode_seed

    features = {"observation.state": {"dtype": "float32", "shape": [8]}, "action": {"dtype": "float32", "shape": [7]}}
    with LeRobotWriter(tmp_path / "demos", fps=10, features=features) as writer:
        for i, task in enumerate(["pick up the bowl", "pick up the bowl", "open the drawer"]):
            writer.add_episode({"observation.state": np.zeros((3, 8), np.float32),
                                "action": np.full((3, 7), i, np.float32)}, task=task)
    dataset = ReplayDataset(tmp_path / "demos")
    picked = {dataset.match("x/0", seed, "Pick up the  bowl")[0].index for seed in range(8)}
    assert picked == {0, 1} and dataset.match("x/0", 1, "open the drawer")[1] == "instruction"
    assert dataset.match("x/0", episode_seed("x/0", 0, 0), "close the window") is None


def test_validate_checks_the_replay_dataset(cli, tmp_path):
    from tests.helpers import one_line_error

    fixture = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "lerobot_v30_sample"
    # the fixture is recorded at 10 fps (LIBERO's datasets at 20): the recipe's half-frame offsets would not exist
    args = ["validate", "libero_cpu", f"data.root={fixture}",
            f"data.delta_timestamps.action=[{','.join(str(i / 10) for i in range(10))}]"]
    assert cli(*args).code == 0  # replays the training dataset by default (${data.root})
    result = cli(*args, f"eval.suite_options.replay_dataset={tmp_path}/nope")
    assert result.code == 2
    one_line_error(result, "eval.suite_options.replay_dataset", "does not exist")
    result = cli(*args, "eval.suite_options.replay_dataset=''")
    assert result.code == 2
    one_line_error(result, "eval.reference_policies", "replay_dataset")
