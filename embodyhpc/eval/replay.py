"""The "replay" reference row: a dataset's recorded actions played back open-loop, as a check of the env conventions.

    eval:
      suite: libero
      suite_options: {replay_dataset: /data/libero-demos}   # a LeRobot v3.0 dataset
      reference_policies: [random, replay]

LIBERO has no scripted expert, so its other reference row is random. Replaying recorded actions in the suite tells
whether the suite's action frame, gripper sign and initial states are the dataset's: same initial state + same
actions = same outcome (the physics is deterministic), and the replayed states follow the recorded ones.

Which recorded episode an evaluated episode replays:
- exact: an episode recorded by `embodyhpc data synth` / `eval.record` carries env_task, env_seed and env_episode
  (meta/episodes), the triple the suite turns back into the same initial state: the evaluated episode with that
  triple replays it. Its outcome must be the recorded one, and the observed state must follow the recorded
  observation.state step for step: `max_state_error` (largest absolute difference over the replayed steps) above
  STATE_TOLERANCE says the conventions differ (or the env is not deterministic), and is printed as a warning.
- by instruction: other LeRobot datasets (LeRobot's and openpi's LIBERO conversions of the LIBERO demos) record no
  initial-state index. An evaluated episode replays the dataset episode of the task's instruction picked by its
  seed; it starts from the benchmark's initial state, not the demo's, so success is only indicative (a gripper of
  the wrong sign gives none), and the state error is reported, not judged.
After the recorded actions the arm holds still with the last gripper command.

The record of each replayed episode carries a "replay" field (rollout.run_episode asks the policy's episode_info):
the dataset episode, how it was matched, its recorded success, the steps replayed and max_state_error.
`gripper_sign(dataset)` reads the gripper convention off the recorded data alone (no simulator).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from embodyhpc.eval.suites import Obs, Suite, episode_seed

STATE_KEY, ACTION_KEY = "observation.state", "action"
STATE_TOLERANCE = 1e-4
"""Largest state difference (m, rad) an exact replay may show: same init state and actions give the same floats."""
GRIPPER_ACTION, GRIPPER_STATE = 6, 6  # LIBERO: action[6] the gripper command, state[6] the first finger's position


@dataclass(frozen=True)
class RecordedEpisode:
    index: int
    instruction: str
    actions: np.ndarray  # (T, action_dim) float32
    states: np.ndarray | None  # (T, state_dim): the observation each action was taken on
    env_triple: tuple[str, int, int] | None  # (env_task, env_seed, env_episode) when the recorder wrote them
    success: bool | None


class ReplayDataset:
    """The actions (and states) of a LeRobot v3.0 dataset's episodes, read from its parquet files (no video)."""

    def __init__(self, root: str | os.PathLike) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from embodyhpc.data.formats import read_lerobot_info

        self.root = Path(root)
        info = read_lerobot_info(self.root)
        features = info.get("features", {})
        if ACTION_KEY not in features:
            raise ValueError(f"{self.root}: the dataset has no {ACTION_KEY!r} feature to replay")
        episode_files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        data_files = sorted((self.root / "data").glob("chunk-*/file-*.parquet"))
        if not episode_files or not data_files:
            raise ValueError(f"{self.root}: not a LeRobot v3.0 dataset (meta/episodes and data parquet files)")
        episodes = pa.concat_tables([pq.read_table(p) for p in episode_files]).to_pylist()
        columns = ["episode_index", "frame_index", ACTION_KEY] + ([STATE_KEY] if STATE_KEY in features else [])
        frames = pa.concat_tables([pq.read_table(p, columns=columns) for p in data_files])
        episode_of = frames.column("episode_index").to_numpy()
        order = np.lexsort((frames.column("frame_index").to_numpy(), episode_of))
        actions = np.asarray(frames.column(ACTION_KEY).to_pylist(), dtype=np.float32)[order]
        states = (np.asarray(frames.column(STATE_KEY).to_pylist(), dtype=np.float32)[order]
                  if STATE_KEY in columns else None)
        episode_of = episode_of[order]
        self.episodes: list[RecordedEpisode] = []
        for row in sorted(episodes, key=lambda r: r["episode_index"]):
            rows = episode_of == row["episode_index"]
            tasks = row.get("tasks") or [""]
            triple = None
            if all(row.get(k) is not None for k in ("env_task", "env_seed", "env_episode")):
                triple = (str(row["env_task"]), int(row["env_seed"]), int(row["env_episode"]))
            success = row.get("success")
            self.episodes.append(RecordedEpisode(int(row["episode_index"]), str(tasks[0]), actions[rows],
                                                 states[rows] if states is not None else None, triple,
                                                 None if success is None else bool(success)))
        self._by_seed = {episode_seed(*e.env_triple): e for e in self.episodes if e.env_triple is not None}

    def match(self, task: str, seed: int, instruction: str) -> tuple[RecordedEpisode, str] | None:
        """The recorded episode an evaluated episode (its task and `episode_seed`) replays, and how it matched."""
        exact = self._by_seed.get(seed)
        if exact is not None and exact.env_triple is not None and exact.env_triple[0] == task:
            return exact, "initial state"
        same = self.for_instruction(instruction)
        if not same:
            return None
        return same[seed % len(same)], "instruction"

    def for_instruction(self, instruction: str) -> list[RecordedEpisode]:
        wanted = _words(instruction)
        return [e for e in self.episodes if _words(e.instruction) == wanted]


def _words(text: str) -> str:
    return " ".join(text.lower().replace("_", " ").split())


class ReplayPolicy:
    """The recorded actions of the matched episode, one per step (see the module doc)."""

    def __init__(self, suite: Suite, root: str | os.PathLike | None = None) -> None:
        """`root`: the dataset (default: the suite's replay_dataset, what the reference-policy registry uses)."""
        root = root or getattr(suite, "replay_dataset", None)
        if not root:
            raise ValueError(f"the {suite.name} suite has no replay dataset (eval.suite_options.replay_dataset)")
        self._suite = suite
        self.dataset = ReplayDataset(root)
        uncovered = [t for t in suite.tasks if not self.dataset.for_instruction(suite.instruction(t))
                     and not any(e.env_triple and e.env_triple[0] == t for e in self.dataset.episodes)]
        if uncovered:
            raise ValueError(f"{root} holds no episode of {len(uncovered)} evaluated task(s) "
                             f"({', '.join(uncovered[:4])}): evaluate the tasks it covers, or drop 'replay' from "
                             "eval.reference_policies")
        self._episode: RecordedEpisode | None = None

    def reset(self, task: str, seed: int) -> None:
        found = self.dataset.match(task, seed, self._suite.instruction(task))
        if found is None:
            raise ValueError(f"{self.dataset.root} holds no episode of {task} ({self._suite.instruction(task)!r})")
        self._episode, self._matched = found
        self._task, self._step, self._max_error = task, 0, 0.0
        self._hold = np.zeros(self._episode.actions.shape[1], dtype=np.float32)

    def act(self, obs: Obs) -> np.ndarray:
        if self._episode is None:
            raise RuntimeError("call reset(task, seed) before act()")
        episode, step = self._episode, self._step
        self._step += 1
        if step >= len(episode.actions):  # done replaying: hold still, keep the last gripper command
            return self._hold
        if episode.states is not None and STATE_KEY in obs:
            observed = np.asarray(obs[STATE_KEY], dtype=np.float32)
            if observed.shape == episode.states[step].shape:
                self._max_error = max(self._max_error, float(np.abs(observed - episode.states[step]).max()))
        action = episode.actions[step]
        self._hold[-1] = action[-1]
        return action.copy()

    def episode_info(self) -> dict[str, Any]:
        """What the episode's record carries under "replay" (module doc); warns when an exact replay diverges."""
        episode = self._episode
        if episode is None:
            return {}
        info = {"dataset_episode": episode.index, "matched": self._matched, "recorded_success": episode.success,
                "steps_replayed": min(self._step, len(episode.actions)), "recorded_steps": len(episode.actions),
                "max_state_error": self._max_error if episode.states is not None else None}
        if self._matched == "initial state" and self._max_error > STATE_TOLERANCE:
            print(f"replay: {self._task} (dataset episode {episode.index}) diverges from the recorded states by "
                  f"{self._max_error:.4g} (> {STATE_TOLERANCE}): the dataset's action frame, gripper sign or initial "
                  "state is not the suite's", flush=True)
        return info


def gripper_sign(dataset: ReplayDataset, *, action_dim: int = GRIPPER_ACTION, state_dim: int = GRIPPER_STATE) -> float:
    """The correlation of the gripper command with the next change of the first finger's position, over all recorded
    steps: negative when +1 closes (the LIBERO env's convention: the finger moves towards 0), positive when the
    dataset's sign is flipped, near 0 when the data cannot tell (a gripper that never moves)."""
    commands, moves = [], []
    for episode in dataset.episodes:
        if episode.states is None or len(episode.states) < 2:
            continue
        commands.append(episode.actions[:-1, action_dim])
        moves.append(np.diff(episode.states[:, state_dim]))
    if not commands:
        raise ValueError(f"{dataset.root}: no episode with {STATE_KEY} over two steps or more")
    command, move = np.concatenate(commands), np.concatenate(moves)
    if command.std() == 0 or move.std() == 0:
        return 0.0
    return float(np.corrcoef(command, move)[0, 1])


__all__ = ["RecordedEpisode", "ReplayDataset", "ReplayPolicy", "STATE_TOLERANCE", "gripper_sign"]
