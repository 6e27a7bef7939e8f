"""Demonstrations from MetaWorld v3's scripted experts, written as a LeRobot v3.0 dataset.

    from embodyhpc.sim.metaworld import generate_demos
    summary = generate_demos("/data/mt4_demos", tasks=["reach-v3", "push-v3"], episodes_per_task=5, seed=0)
    print(summary.num_episodes, summary.seconds_per_episode)

Each episode: one goal variant of one task (`metaworld.MT1(task, seed)` holds 50 per seed; episode e of a task
uses variant e % 50 of MT1(task, seed + e // 50)), rolled out by the task's expert from `metaworld.policies`
until the first step with info["success"] (or `max_steps`). Frame t holds the observation before step t and
the action taken there (LeRobot's convention):

    observation.state              float32 (4,)   hand x, y, z and gripper opening: what a VLA sees
    observation.environment_state  float32 (39,)  MetaWorld's full observation (hand, gripper, two objects'
                                                  position + quaternion, the same 18 values one step earlier,
                                                  goal position): privileged state for state-only policies
    observation.images.<camera>    video (H, W, 3) per camera, rendered on the CPU
    action                         float32 (4,)   dx, dy, dz, gripper effort, clipped to the action space [-1, 1]
    next.reward, next.success      float32, bool  reward and success after the step

meta/episodes gets extra columns: success (bool), env_name, env_seed and env_variant, which
`make_env(env_name, env_seed, env_variant)` turns back into the exact initial state. Episodes that end
without success are dropped unless `keep_failed=True` (the summary counts them).

Rendering needs no GPU: MuJoCo's EGL backend on Mesa's llvmpipe (MUJOCO_GL=egl, set here unless already
set; Debian 12 packages: libegl1 libgl1-mesa-dri libopengl0). Shadows and reflections are off and
multisampling is 0, which is ~10x faster than MuJoCo's defaults on CPU. MetaWorld's fixed corner cameras look
at the table upside down; their images are turned 180 degrees so that up is up.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embodyhpc.data.video_encode import VideoOptions
from embodyhpc.data.writer import LeRobotWriter, dataset_size_bytes
from embodyhpc.errors import RunFailure, UserError

MT10_TASKS = (
    "reach-v3", "push-v3", "pick-place-v3", "door-open-v3", "drawer-open-v3",
    "drawer-close-v3", "button-press-topdown-v3", "peg-insert-side-v3", "window-open-v3", "window-close-v3",
)
INSTRUCTIONS = {
    "reach-v3": "reach the red goal with the gripper",
    "push-v3": "push the puck to the goal",
    "pick-place-v3": "pick up the puck and place it at the goal",
    "door-open-v3": "open the door",
    "drawer-open-v3": "open the drawer",
    "drawer-close-v3": "close the drawer",
    "button-press-topdown-v3": "press the button down from the top",
    "peg-insert-side-v3": "insert the peg into the hole from the side",
    "window-open-v3": "slide the window open",
    "window-close-v3": "slide the window closed",
}
VARIANTS_PER_SEED = 50  # goal variants metaworld.MT1 makes per seed
MAX_SEED = 2**32 - 1  # MT1 seeds numpy's legacy RandomState; episode e of a task uses seed + e // 50
CAMERAS = ("corner", "corner2", "corner3", "corner4", "topview", "behindGripper", "gripperPOV")
"""The cameras of every MetaWorld v3 task's model (tests/sim/test_metaworld.py compares them with the models)."""
INSTALL_HINT = ("CPU rendering needs MUJOCO_GL=egl and Mesa's EGL: apt-get install -y --no-install-recommends "
                "libegl1 libgl1-mesa-dri libopengl0 (or pass cameras=() for state-only demos)")

STATE_NAMES = ["hand_x", "hand_y", "hand_z", "gripper_opening"]
# Two object slots of position + quaternion (zeros where a task has one object; the quaternion's component order
# is the task's own: MuJoCo's w-first for most, scipy's w-last for a few), then the same 18 values one step
# earlier, then the goal.
_OBJECT_NAMES = [f"obj{o}_{c}" for o in (1, 2) for c in ("x", "y", "z", "q0", "q1", "q2", "q3")]
ENVIRONMENT_STATE_NAMES = [*STATE_NAMES, *_OBJECT_NAMES, *[f"prev_{n}" for n in [*STATE_NAMES, *_OBJECT_NAMES]],
                           "goal_x", "goal_y", "goal_z"]
ACTION_NAMES = ["dx", "dy", "dz", "gripper_effort"]


def instruction_for(env_name: str) -> str:
    """The language instruction for a task: written for MT10, derived from the name for the others."""
    return INSTRUCTIONS.get(env_name) or env_name.removesuffix("-v3").replace("-", " ")


def use_headless_gl() -> None:
    # MuJoCo picks its GL backend when it is first imported; without a display the default (GLFW) cannot work.
    if "mujoco" not in sys.modules:
        os.environ.setdefault("MUJOCO_GL", "egl")


def _metaworld() -> Any:
    use_headless_gl()
    try:
        import metaworld
        import metaworld.policies
    except ImportError as exc:
        raise ImportError(f"MetaWorld is not installed ({exc}); install it with: pip install 'metaworld==3.1.1' "
                          "packaging (or the project's [sim] extra)") from exc
    return metaworld


def known_tasks() -> list[str]:
    """Every MetaWorld v3 task with a scripted expert."""
    return sorted(_metaworld().policies.ENV_POLICY_MAP)


@functools.lru_cache(maxsize=32)
def _benchmark(env_name: str, env_seed: int) -> Any:
    # Building MT1 resets an env 50 times (~2 s); its tasks are immutable, so one build serves every caller.
    return _metaworld().MT1(env_name, seed=env_seed)


def goal_variant(env_name: str, env_seed: int, env_variant: int) -> Any:
    """The metaworld Task (goal and object placement) `env.set_task` takes for this variant."""
    policies = _metaworld().policies.ENV_POLICY_MAP
    if env_name not in policies:
        raise ValueError(f"unknown MetaWorld task {env_name!r}; tasks with experts: {', '.join(sorted(policies))}")
    if not 0 <= env_variant < VARIANTS_PER_SEED:
        raise ValueError(f"env_variant must be in [0, {VARIANTS_PER_SEED}), got {env_variant}")
    return _benchmark(env_name, int(env_seed)).train_tasks[env_variant]


def make_env(env_name: str, env_seed: int, env_variant: int) -> Any:
    """A fresh MetaWorld env set to one goal variant (as recorded in meta/episodes); call `reset()` next."""
    task = goal_variant(env_name, env_seed, env_variant)
    env = _benchmark(env_name, int(env_seed)).train_classes[env_name]()
    env.set_task(task)
    return env


class CameraRenderer:
    """Renders one named camera of a MuJoCo model to uint8 (H, W, 3) RGB, with the fast CPU settings."""

    def __init__(self, model: Any, camera: str, height: int, width: int) -> None:
        import mujoco

        camera_id = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, camera)
        if camera_id < 0:
            names = [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]
            raise ValueError(f"no camera {camera!r} in this model; cameras: {', '.join(names)}")
        self.camera, self.camera_id = camera, camera_id
        # Both are read when the GL context is made, so they must be set before the Renderer exists.
        model.vis.quality.offsamples = 0
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, width)
        model.vis.global_.offheight = max(model.vis.global_.offheight, height)
        try:
            self._renderer = mujoco.Renderer(model, height, width)
        except Exception as exc:  # missing EGL/Mesa libraries surface as AttributeError, OpenGL or MuJoCo errors
            raise RuntimeError(f"cannot render camera {camera!r} on the CPU: {type(exc).__name__}: {exc}. "
                               f"{INSTALL_HINT}") from exc
        self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
        self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0
        # A fixed camera whose image "up" axis points below the horizon renders the scene upside down
        # (all four MetaWorld corner cameras): turn its images by 180 degrees. Tracking cameras are left alone.
        fixed = model.cam_mode[camera_id] == mujoco.mjtCamLight.mjCAMLIGHT_FIXED
        up_z = float(model.cam_mat0[camera_id].reshape(3, 3)[2, 1])
        self.rotate_180 = bool(fixed and up_z < 0)

    def render(self, data: Any) -> np.ndarray:
        self._renderer.update_scene(data, camera=self.camera_id)
        image = self._renderer.render()
        return np.ascontiguousarray(image[::-1, ::-1]) if self.rotate_180 else image

    def close(self) -> None:
        # Free the GL context now: left to interpreter exit, EGL teardown raises (seen with Mesa llvmpipe).
        self._renderer.close()


@dataclass(frozen=True)
class EpisodeSpec:
    """Which rollout: a task and one of its goal variants (`make_env` arguments)."""

    env_name: str
    env_seed: int
    env_variant: int


@dataclass
class Episode:
    """One expert rollout: per-frame arrays (leading axis T) keyed like the dataset features, and the outcome."""

    spec: EpisodeSpec
    frames: dict[str, np.ndarray]
    success: bool
    sim_s: float
    render_s: float

    @property
    def length(self) -> int:
        return len(self.frames["action"])


def episode_spec(env_name: str, seed: int, episode: int) -> EpisodeSpec:
    """Episode e of a task under `seed`: variant e % 50 of MT1(task, seed + e // 50)."""
    return EpisodeSpec(env_name, seed + episode // VARIANTS_PER_SEED, episode % VARIANTS_PER_SEED)


def episode_specs(tasks: Sequence[str], episodes_per_task: int, seed: int) -> list[EpisodeSpec]:
    """Episode e of a task uses variant e % 50 of MT1(task, seed + e // 50): the same seed, the same episodes."""
    return [episode_spec(env_name, seed, e) for env_name in tasks for e in range(episodes_per_task)]


def make_expert(env_name: str) -> Any:
    """A fresh scripted expert of a task from `metaworld.policies` (`get_action(obs)` on the 39-d observation)."""
    policies = _metaworld().policies.ENV_POLICY_MAP
    if env_name not in policies:
        raise ValueError(f"unknown MetaWorld task {env_name!r}; tasks with experts: {', '.join(sorted(policies))}")
    return policies[env_name]()


def rollout_expert(env: Any, policy: Any, max_steps: int, stop_on_success: bool = True,
                   ) -> tuple[dict[str, np.ndarray], bool]:
    """Run the expert from `env.reset()` without rendering; returns (frames without images, success)."""
    obs, _ = env.reset()
    states, actions, rewards, successes = [], [], [], []
    low, high = env.action_space.low, env.action_space.high
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Constant\\(s\\) may be too high")  # the experts' gain warning
        for _ in range(max_steps):
            states.append(obs.astype(np.float32))
            # A copy: some experts edit the observation they are given in place (door-open-v3 shifts the handle
            # position by 5 cm), which would corrupt the recorded state. Clipping changes nothing the env does
            # (it clips too); it keeps the recorded actions in the action space.
            action = np.clip(policy.get_action(obs.copy()), low, high).astype(np.float32)
            actions.append(action)
            obs, reward, _, truncated, info = env.step(action)
            rewards.append(reward)
            successes.append(bool(info["success"]))
            if (successes[-1] and stop_on_success) or truncated:
                break
    environment_state = np.stack(states)
    frames = {
        "observation.state": environment_state[:, :4].copy(),
        "observation.environment_state": environment_state,
        "action": np.stack(actions),
        "next.reward": np.asarray(rewards, dtype=np.float32),
        "next.success": np.asarray(successes, dtype=bool),
    }
    return frames, any(successes)


def render_replay(env: Any, frames: dict[str, np.ndarray],
                  renderers: Sequence[CameraRenderer]) -> dict[str, np.ndarray]:
    """Replay the recorded actions from `env.reset()` and render every frame: {image key: uint8 (T, H, W, 3)}.

    Rendering costs ~10x a simulation step, so episodes are rendered only once they are known to be kept.
    The replay must pass through exactly the recorded states (MuJoCo is deterministic); anything else raises.
    """
    obs, _ = env.reset()
    images: dict[str, list[np.ndarray]] = {r.camera: [] for r in renderers}
    for t, action in enumerate(frames["action"]):
        if not np.array_equal(obs.astype(np.float32), frames["observation.environment_state"][t]):
            raise RuntimeError(f"replaying {env.unwrapped.task_name} diverged from the recorded rollout at step {t}; "
                               "the simulation is not deterministic here (different MuJoCo build or threads?)")
        for renderer in renderers:
            images[renderer.camera].append(renderer.render(env.unwrapped.data))
        obs, *_ = env.step(action)
    return {f"observation.images.{camera}": np.stack(stack) for camera, stack in images.items()}


class ExpertRunner:
    """Rolls out episodes of any task; keeps the env, expert and renderers of the task it ran last."""

    def __init__(self, cameras: Sequence[str], image_size: int, max_steps: int | None, stop_on_success: bool,
                 render_failed: bool) -> None:
        self.cameras, self.image_size = tuple(cameras), image_size
        self.max_steps, self.stop_on_success, self.render_failed = max_steps, stop_on_success, render_failed
        self._env_name: str | None = None
        self._env: Any = None
        self._policy: Any = None
        self._renderers: list[CameraRenderer] = []

    def _switch_task(self, spec: EpisodeSpec) -> None:
        self.close()
        self._env_name = spec.env_name
        self._env = make_env(spec.env_name, spec.env_seed, spec.env_variant)
        self._policy = _metaworld().policies.ENV_POLICY_MAP[spec.env_name]()
        self._renderers = [CameraRenderer(self._env.model, c, self.image_size, self.image_size) for c in self.cameras]

    def __call__(self, spec: EpisodeSpec) -> Episode:
        if spec.env_name != self._env_name:
            self._switch_task(spec)
        self._env.set_task(goal_variant(spec.env_name, spec.env_seed, spec.env_variant))
        start = time.perf_counter()
        frames, success = rollout_expert(self._env, self._policy, self.max_steps or self._env.max_path_length,
                                         self.stop_on_success)
        middle = time.perf_counter()
        if success or self.render_failed:
            frames.update(render_replay(self._env, frames, self._renderers))
        return Episode(spec, frames, success, sim_s=middle - start, render_s=time.perf_counter() - middle)

    def close(self) -> None:
        for renderer in self._renderers:
            renderer.close()
        if self._env is not None:
            self._env.close()
        self._env_name, self._env, self._renderers = None, None, []


def dataset_features(cameras: Sequence[str], image_size: int) -> dict[str, dict[str, Any]]:
    features: dict[str, dict[str, Any]] = {
        f"observation.images.{camera}": {"dtype": "video", "shape": [image_size, image_size, 3]} for camera in cameras
    }
    features.update({
        "observation.state": {"dtype": "float32", "shape": [4], "names": STATE_NAMES},
        "observation.environment_state": {"dtype": "float32", "shape": [39], "names": ENVIRONMENT_STATE_NAMES},
        "action": {"dtype": "float32", "shape": [4], "names": ACTION_NAMES},
        "next.reward": {"dtype": "float32", "shape": [1], "names": None},
        "next.success": {"dtype": "bool", "shape": [1], "names": None},
    })
    return features


_WORKER_RUNNER: ExpertRunner | None = None


def _init_worker(runner_args: tuple) -> None:
    global _WORKER_RUNNER
    # One llvmpipe thread per process: the processes already fill the cores.
    os.environ.setdefault("LP_NUM_THREADS", "1")
    _WORKER_RUNNER = ExpertRunner(*runner_args)


def _run_in_worker(spec: EpisodeSpec) -> Episode:
    assert _WORKER_RUNNER is not None
    return _WORKER_RUNNER(spec)


def expert_episodes(specs: Sequence[EpisodeSpec], *, cameras: Sequence[str], image_size: int,
                    max_steps: int | None = None, stop_on_success: bool = True, render_failed: bool = False,
                    num_workers: int = 1) -> Iterator[Episode]:
    """Episodes in the order of `specs`; with num_workers > 1, rolled out by that many spawned processes.

    Every episode depends on its spec alone (the expert is a function of the observation, the env is reset
    from the variant), so the result is the same for any number of workers.
    """
    runner_args = (tuple(cameras), image_size, max_steps, stop_on_success, render_failed)
    if num_workers <= 1:
        runner = ExpertRunner(*runner_args)
        try:
            yield from map(runner, specs)
        finally:
            runner.close()
        return
    import multiprocessing

    # spawn, not fork: a forked child must not inherit the parent's GL or MuJoCo state.
    context = multiprocessing.get_context("spawn")
    with context.Pool(num_workers, initializer=_init_worker, initargs=(runner_args,)) as pool:
        yield from pool.imap(_run_in_worker, specs)


@dataclass
class DemoSummary:
    """What `generate_demos` wrote and how long it took."""

    root: Path
    num_episodes: int
    num_frames: int
    num_attempted: int
    kept_by_task: dict[str, int] = field(default_factory=dict)
    attempted_by_task: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    sim_s: float = 0.0
    """Seconds in expert rollouts without rendering (summed over workers)."""
    render_s: float = 0.0
    """Seconds replaying kept episodes with rendering (summed over workers)."""
    num_rendered_frames: int = 0
    size_bytes: int = 0

    @property
    def seconds_per_episode(self) -> float:
        return self.wall_s / max(self.num_attempted, 1)

    @property
    def render_fps(self) -> float:
        """Camera images per second of replay-and-render time (a simulation step included per frame)."""
        return self.num_rendered_frames / self.render_s if self.render_s else 0.0


def _progress(enabled: bool, total: int) -> tuple[Any, Callable[..., None]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    # stderr: stdout is the summary line a script reads (rich's default console is stdout; piped, it printed there)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        disable=not enabled, console=Console(stderr=True))
    task_id = progress.add_task("expert demos", total=total)
    return progress, lambda **kwargs: progress.update(task_id, **kwargs)


def generate_demos(out_dir: str | os.PathLike, tasks: Sequence[str] = MT10_TASKS[:4], episodes_per_task: int = 5, *,
                   seed: int = 0, cameras: str | Sequence[str] = ("corner",), image_size: int = 64,
                   max_steps: int | None = None, keep_failed: bool = False, stop_on_success: bool = True,
                   num_workers: int = 1, video: VideoOptions | None = None, overwrite: bool = False,
                   progress: bool = True) -> DemoSummary:
    """Roll out MetaWorld's scripted experts and write the episodes to `out_dir` as a LeRobot v3.0 dataset.

    tasks: MetaWorld v3 task names (default: the first four of MT10); `known_tasks()` lists them all.
    episodes_per_task: rollouts per task; failed ones are dropped unless keep_failed, so a task may keep fewer.
    seed: decides every goal variant (see `episode_specs`); the same seed writes the same dataset.
    cameras: MetaWorld camera names (`CAMERAS`), each once; () for a state-only dataset.
    image_size: square image side in pixels (even, >= 2).
    max_steps: step limit per episode (default and upper bound: the task's 500).
    stop_on_success: end an episode at its first successful step (else run to max_steps).
    num_workers: processes rolling out episodes (at most one per episode); the dataset is byte-identical for any
        number. Workers are spawned, so a script calling this with num_workers > 1 needs the
        `if __name__ == "__main__":` guard.
    video: codec settings (default h264, keyframe every 2 frames; see embodyhpc.data.writer).
    """
    cameras = (cameras,) if isinstance(cameras, str) else tuple(cameras)
    tasks = list(tasks)
    _check_demo_args(tasks, episodes_per_task, seed, cameras, image_size, max_steps, num_workers)
    start = time.perf_counter()
    specs = episode_specs(tasks, episodes_per_task, seed)
    summary = DemoSummary(root=Path(out_dir), num_episodes=0, num_frames=0, num_attempted=0)
    writer = LeRobotWriter(out_dir, fps=_control_fps(tasks[0]), features=dataset_features(cameras, image_size),
                           robot_type="sawyer", video=video, overwrite=overwrite)
    bar, update = _progress(progress, len(specs))
    with bar, writer:
        for episode in expert_episodes(specs, cameras=cameras, image_size=image_size, max_steps=max_steps,
                                       stop_on_success=stop_on_success, render_failed=keep_failed,
                                       num_workers=min(num_workers, len(specs))):
            name = episode.spec.env_name
            summary.num_attempted += 1
            summary.attempted_by_task[name] = summary.attempted_by_task.get(name, 0) + 1
            summary.kept_by_task.setdefault(name, 0)
            summary.sim_s += episode.sim_s
            summary.render_s += episode.render_s
            if episode.success or keep_failed:
                summary.num_rendered_frames += episode.length * len(cameras)
                writer.add_episode(episode.frames, task=instruction_for(name), extra={
                    "success": episode.success, "env_name": name, "env_seed": episode.spec.env_seed,
                    "env_variant": episode.spec.env_variant})
                summary.kept_by_task[name] += 1
            kept, attempted = summary.kept_by_task[name], summary.attempted_by_task[name]
            update(advance=1, description=f"{name}: kept {kept}/{attempted}")
        if writer.num_episodes == 0:
            raise RunFailure(f"none of the {summary.num_attempted} expert episodes succeeded within "
                               f"{max_steps or 'the default'} steps; raise max_steps or pass keep_failed=True")
    summary.num_episodes, summary.num_frames = writer.num_episodes, writer.num_frames
    summary.wall_s = time.perf_counter() - start
    summary.size_bytes = dataset_size_bytes(out_dir)
    return summary


def _check_demo_args(tasks: list[str], episodes_per_task: int, seed: int, cameras: tuple[str, ...], image_size: int,
                     max_steps: int | None, num_workers: int) -> None:
    """UserError naming the argument, before anything is written (`embodyhpc data synth` checks its options first)."""
    unknown = sorted(set(tasks) - set(known_tasks()))
    if unknown or not tasks:
        raise UserError(f"unknown MetaWorld tasks {unknown or tasks}", key="tasks",
                        fix=f"choose from: {', '.join(known_tasks())}")
    twice = sorted({t for t in tasks if tasks.count(t) > 1})
    if twice:
        raise UserError(f"{', '.join(twice)} named more than once", key="tasks",
                        fix="name each task once (episodes_per_task sets how many episodes each gets)")
    if episodes_per_task < 1:
        raise UserError(f"must be >= 1, got {episodes_per_task}", key="episodes_per_task")
    last_seed = seed + (episodes_per_task - 1) // VARIANTS_PER_SEED
    if seed < 0 or last_seed > MAX_SEED:
        raise UserError(f"seed {seed} with {episodes_per_task} episodes per task seeds MT1 up to {last_seed}; numpy "
                        f"takes 0..{MAX_SEED}", key="seed", fix="use a seed from 0 to 2147483647")
    wrong = [c for c in cameras if c not in CAMERAS] or sorted({c for c in cameras if cameras.count(c) > 1})
    if wrong:
        raise UserError(f"{'unknown' if wrong[0] not in CAMERAS else 'repeated'} camera {wrong[0]!r}", key="cameras",
                        fix=f"name each once, from: {', '.join(CAMERAS)} (or none for state-only demos)")
    if cameras and (image_size < 2 or image_size % 2):
        raise UserError(f"must be an even number >= 2 (yuv420p video), got {image_size}", key="image_size")
    if max_steps is not None and max_steps < 1:
        raise UserError(f"must be >= 1, got {max_steps}", key="max_steps")
    if num_workers < 1:
        raise UserError(f"must be >= 1, got {num_workers}", key="num_workers")


def _control_fps(env_name: str) -> int:
    """Steps per second of the env (MetaWorld: 5 physics steps of 2.5 ms = 80 Hz); the dataset's fps."""
    _metaworld()
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    env = ALL_V3_ENVIRONMENTS[env_name]()
    try:
        fps = round(1 / env.dt)
        if abs(fps * env.dt - 1) > 1e-9:
            raise ValueError(f"{env_name}: control period {env.dt} s is not a whole number of frames per second")
        return fps
    finally:
        env.close()


__all__ = [
    "CAMERAS", "ENVIRONMENT_STATE_NAMES", "INSTRUCTIONS", "MT10_TASKS", "CameraRenderer", "DemoSummary", "Episode",
    "EpisodeSpec", "ExpertRunner", "dataset_features", "episode_spec", "episode_specs", "expert_episodes",
    "generate_demos", "goal_variant", "instruction_for", "known_tasks", "make_env", "make_expert", "render_replay",
    "rollout_expert",
]
