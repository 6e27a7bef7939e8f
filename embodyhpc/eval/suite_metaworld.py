"""The "metaworld" evaluation suite: MetaWorld v3 tasks, reset exactly like the demo generator.

Episode (task, seed, episode) is goal variant `episode % 50` of `MT1(task, seed + episode // 50)`
(embodyhpc.sim.metaworld.episode_spec / make_env). Observations, as in the demo datasets:

    observation.state              float32 (4,)   hand x, y, z, gripper opening (obs[:4])
    observation.environment_state  float32 (39,)  MetaWorld's full observation
    observation.images.<camera>    uint8 (S, S, 3) rendered by CameraRenderer (corner cameras turned upright)
    task                           str            the instruction (instruction_for)

Success is MetaWorld's info["success"]; done is the env's truncation at max_path_length (500 steps).

Building a MetaWorld env costs ~0.25 s and a camera renderer (a GL context) ~0.5 s, 5-500x an episode's
simulation, so the suite keeps the simulators of the tasks it ran last: `EvalEnv.close()` hands one back and the
next `make_env` of that task sets the new goal variant on it. `reset()` after `set_task` gives the same
initial state as a fresh env (tested), so reuse changes no result.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from embodyhpc.eval.suites import Obs, check_action
from embodyhpc.sim import metaworld as mw

DEFAULT_VIDEO_CAMERA = "corner"


def expand_tasks(tasks: Sequence[str]) -> list[str]:
    """Task names with "MT10" / "MT50" expanded, duplicates dropped, order kept; unknown names raise."""
    known = mw.known_tasks()
    out: list[str] = []
    for name in tasks:
        group = {"MT10": list(mw.MT10_TASKS), "MT50": known}.get(name.upper())
        for task in group or [name]:
            if task not in known:
                raise ValueError(f"unknown MetaWorld task {task!r}; use MT10, MT50 or one of: {', '.join(known)}")
            if task not in out:
                out.append(task)
    if not out:
        raise ValueError("the metaworld suite needs at least one task")
    return out


class _Simulator:
    """One MetaWorld env of a task with its camera renderers (the expensive part, reused across episodes)."""

    def __init__(self, task: str, seed: int, episode: int, cameras: Sequence[str], image_size: int) -> None:
        spec = mw.episode_spec(task, seed, episode)
        self.task = task
        self.env = mw.make_env(spec.env_name, spec.env_seed, spec.env_variant)
        self.renderers = [mw.CameraRenderer(self.env.model, c, image_size, image_size) for c in cameras]
        self.video_renderer: mw.CameraRenderer | None = None

    def close(self) -> None:
        for renderer in [*self.renderers, *([self.video_renderer] if self.video_renderer else [])]:
            renderer.close()
        self.env.close()


class MetaWorldEnv:
    """One episode of a MetaWorld task (see the module docstring)."""

    def __init__(self, suite: MetaWorldSuite, sim: _Simulator, seed: int, episode: int) -> None:
        self.task, self.seed, self.episode = sim.task, seed, episode
        self._suite, self._sim = suite, sim
        self.action_dim = int(sim.env.action_space.shape[0])
        self.fps = round(1 / sim.env.dt)
        self._instruction = mw.instruction_for(self.task)

    def _obs(self, raw: np.ndarray) -> Obs:
        state = raw.astype(np.float32)
        obs: Obs = {"observation.state": state[:4].copy(), "observation.environment_state": state}
        for renderer in self._sim.renderers:
            obs[f"observation.images.{renderer.camera}"] = renderer.render(self._sim.env.data)
        obs["task"] = self._instruction
        return obs

    def reset(self) -> Obs:
        if self._sim is None:
            raise RuntimeError("this env is closed")
        spec = mw.episode_spec(self.task, self.seed, self.episode)
        self._sim.env.set_task(mw.goal_variant(spec.env_name, spec.env_seed, spec.env_variant))
        raw, _ = self._sim.env.reset()
        return self._obs(raw)

    def step(self, action: np.ndarray) -> tuple[Obs, float, bool, bool]:
        raw, reward, terminated, truncated, info = self._sim.env.step(check_action(action, self.action_dim))
        return self._obs(raw), float(reward), bool(info["success"]), bool(terminated or truncated)

    def render(self) -> np.ndarray:
        sim = self._sim
        if sim.video_renderer is None:
            size = self._suite.video_size
            sim.video_renderer = mw.CameraRenderer(sim.env.model, self._suite.video_camera, size, size)
        return sim.video_renderer.render(sim.env.data)

    def close(self) -> None:
        if self._sim is not None:
            self._suite._release(self._sim)
            self._sim = None


class MetaWorldSuite:
    """MetaWorld v3 tasks; `make_suite("metaworld", tasks, cameras=..., image_size=...)` builds one."""

    name = "metaworld"
    has_expert = True

    def __init__(self, tasks: Sequence[str], *, cameras: Sequence[str] = (), image_size: int = 64,
                 video_camera: str | None = None, video_size: int = 128, max_idle: int = 4) -> None:
        mw.use_headless_gl()
        self.tasks = expand_tasks(tasks)
        self.cameras = tuple(cameras)
        self.image_size = image_size
        self.video_camera = video_camera or (self.cameras[0] if self.cameras else DEFAULT_VIDEO_CAMERA)
        self.video_size = video_size
        self.max_idle = max_idle
        self._idle: OrderedDict[int, _Simulator] = OrderedDict()

    def instruction(self, task: str) -> str:
        self._check(task)
        return mw.instruction_for(task)

    def max_steps(self, task: str) -> int:
        self._check(task)
        from metaworld.env_dict import ALL_V3_ENVIRONMENTS

        return int(ALL_V3_ENVIRONMENTS[task].max_path_length)

    def action_bounds(self, task: str) -> tuple[np.ndarray, np.ndarray]:
        self._check(task)
        ones = np.ones(4, dtype=np.float32)  # MetaWorld: dx, dy, dz, gripper effort, each in [-1, 1]
        return -ones, ones

    def features(self, task: str) -> dict[str, dict[str, Any]]:
        self._check(task)
        features = {f"observation.images.{c}": {"dtype": "uint8", "shape": [self.image_size, self.image_size, 3]}
                    for c in self.cameras}
        features["observation.state"] = {"dtype": "float32", "shape": [4]}
        features["observation.environment_state"] = {"dtype": "float32", "shape": [39]}
        return features

    def make_env(self, task: str, seed: int, episode: int) -> MetaWorldEnv:
        self._check(task)
        if seed < 0 or episode < 0:
            raise ValueError(f"seed and episode must be >= 0, got seed={seed}, episode={episode}")
        sim = next((key for key, s in self._idle.items() if s.task == task), None)
        simulator = self._idle.pop(sim) if sim is not None else _Simulator(task, seed, episode, self.cameras,
                                                                           self.image_size)
        return MetaWorldEnv(self, simulator, seed, episode)

    def expert_policy(self, task: str) -> Callable[[Obs], np.ndarray]:
        """The task's scripted expert as obs -> action (it reads observation.environment_state)."""
        self._check(task)
        expert = mw.make_expert(task)
        return lambda obs: expert_action(expert, obs["observation.environment_state"])

    def _release(self, sim: _Simulator) -> None:
        self._idle[id(sim)] = sim
        while len(self._idle) > self.max_idle:
            self._idle.popitem(last=False)[1].close()

    def _check(self, task: str) -> None:
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not in this suite ({', '.join(self.tasks)})")

    def close(self) -> None:
        while self._idle:
            self._idle.popitem(last=False)[1].close()

    def __enter__(self) -> MetaWorldSuite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def expert_action(expert: Any, environment_state: np.ndarray) -> np.ndarray:
    """The expert's action for a 39-d observation, given a float64 copy (some experts edit it in place)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Constant\\(s\\) may be too high")
        return np.asarray(expert.get_action(np.array(environment_state, dtype=np.float64)), dtype=np.float32)
