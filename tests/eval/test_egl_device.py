"""The EGL device LIBERO renders on: the task's own GPU by EGL_CUDA_DEVICE_NV, never an index taken from Slurm.

EGL's device list is the hardware boundary: the fakes replace `embodyhpc.sim.egl.egl_devices` (the one function that
calls libEGL) with lists whose answer is known by construction. The real seam runs on this machine's Mesa EGL and is
compared with mujoco's own device enumeration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from embodyhpc.errors import RunFailure, UserError
from embodyhpc.eval.suite_libero import egl_device
from embodyhpc.sim import egl
from embodyhpc.sim.egl import EglDevice, choose_egl_device

GPU_ENV = {"CUDA_VISIBLE_DEVICES": "5", "SLURM_STEP_GPUS": "5"}  # Slurm gave the task physical GPU 5


def fake_devices(cuda_ids, *, initialising=None, software=()) -> tuple[list[EglDevice], list[int]]:
    """EGL devices reporting `cuda_ids` (None: no EGL_CUDA_DEVICE_NV); those in `initialising` (default all)
    initialise. The second list records which devices were asked to initialise, in order."""
    probed: list[int] = []

    def probe(index: int) -> bool:
        probed.append(index)
        return initialising is None or index in initialising

    return [EglDevice(cuda_device=c, software=i in software, initialises=lambda i=i: probe(i))
            for i, c in enumerate(cuda_ids)], probed


@pytest.fixture
def seam(monkeypatch):
    """Install a fake device list at the seam; returns the probe log."""
    def install(cuda_ids, **kwargs) -> list[int]:
        devices, probed = fake_devices(cuda_ids, **kwargs)
        monkeypatch.setattr(egl, "egl_devices", lambda: devices)
        return probed
    return install


def test_the_device_whose_cuda_id_matches_is_chosen_in_a_permuted_list() -> None:
    devices, probed = fake_devices([2, 0, 1])
    choice = choose_egl_device(devices, 1)
    assert choice.index == 2 and choice.num_devices == 3
    assert probed == [2]  # no neighbour's GPU is touched
    assert choose_egl_device(fake_devices([2, 0, 1])[0], 0).index == 1
    assert choose_egl_device(fake_devices([2, 0, 1])[0], 2).index == 0


def test_the_shard_renders_on_its_cuda_device_0_whatever_slurm_numbers_it(seam, capsys) -> None:
    probed = seam([2, 0, 1])
    assert egl_device(GPU_ENV) == "1"  # not "5" (Slurm's physical index) nor "0" (EGL's first)
    assert probed == [1]
    assert "libero: rendering on EGL device 1 of 3: its EGL_CUDA_DEVICE_NV is 0" in capsys.readouterr().out


def test_under_a_cgroup_only_the_tasks_gpu_reports_a_cuda_id(seam) -> None:
    """ConstrainDevices: EGL still lists all GPUs; CUDA sees one, so only it reports an ordinal, and only it opens."""
    probed = seam([None, None, None, 0, None], initialising={3})
    assert egl_device({"CUDA_VISIBLE_DEVICES": "0", "SLURM_STEP_GPUS": "3"}) == "3"
    assert probed == [3]


def test_without_the_attribute_the_first_device_that_initialises(seam) -> None:
    probed = seam([None, None, None], initialising={1, 2})
    assert egl_device(GPU_ENV) == "1"
    assert probed == [0, 1]
    devices, _ = fake_devices([None, None], initialising={0})
    assert "no EGL device reports CUDA device 0" in choose_egl_device(devices, 0).why


def test_a_matching_device_that_does_not_initialise_falls_back(seam) -> None:
    probed = seam([1, 0, None], initialising={0, 2})
    assert egl_device(GPU_ENV) == "0"
    assert probed == [1, 0]


def test_the_fallback_keeps_off_other_tasks_gpus(seam) -> None:
    """Without cgroups EGL opens every GPU; those CUDA cannot see report no ordinal (other tasks' GPUs)."""
    probed = seam([0, None, None, 1], initialising={1, 2, 3}, software={2})
    assert egl_device(GPU_ENV) == "3"  # the task's other GPU (its CUDA device 1), not neighbour 1
    assert probed == [0, 3]
    probed = seam([0, None, None], initialising={1, 2}, software={2})
    assert egl_device(GPU_ENV) == "2"  # then a software device before a neighbour's GPU
    assert probed == [0, 2]


def test_a_job_without_gpus_renders_on_a_software_device_first(seam) -> None:
    probed = seam([None, None, None], software={2})
    assert egl_device({"CUDA_VISIBLE_DEVICES": ""}) == "2"  # CPU jobs export CUDA_VISIBLE_DEVICES=""
    assert probed == [2]
    probed = seam([None, None], initialising={0})  # no software device: any that initialises
    assert egl_device({"CUDA_VISIBLE_DEVICES": ""}) == "0"
    assert egl.task_cuda_device({}) == 0 and egl.task_cuda_device({"CUDA_VISIBLE_DEVICES": " "}) is None


@pytest.mark.parametrize(("cuda_ids", "initialising", "message"), [
    ([0, 1], set(), "none of the 2 EGL device(s) initialises"),
    ([], None, "EGL lists no device"),
])
def test_no_device_to_render_on_is_one_line_naming_what_to_set(seam, cuda_ids, initialising, message) -> None:
    seam(cuda_ids, initialising=initialising)
    with pytest.raises(RunFailure) as caught:
        egl_device(GPU_ENV)
    text = str(caught.value)
    assert message in text and "MUJOCO_EGL_DEVICE_ID" in text and "\n" not in text


def test_an_index_past_robosuites_ten_devices_is_refused(seam) -> None:
    seam([None] * 11 + [0])
    with pytest.raises(RunFailure, match="EGL device 11 of 12.*0..9 only"):
        egl_device(GPU_ENV)


def test_a_users_device_stays_and_another_gl_is_left_alone(seam) -> None:
    probed = seam([0])
    assert egl_device({**GPU_ENV, "MUJOCO_EGL_DEVICE_ID": "5"}) is None
    assert egl_device({"MUJOCO_GL": "osmesa"}) is None
    assert egl_device({"MUJOCO_EGL_DEVICE_ID": "2", "CUDA_VISIBLE_DEVICES": ""}) is None
    assert probed == []


@pytest.mark.parametrize(("environ", "message"), [
    ({"MUJOCO_EGL_DEVICE_ID": "gpu1"}, "not an EGL device index"),
    ({"MUJOCO_EGL_DEVICE_ID": "-1"}, "not an EGL device index"),
    ({"MUJOCO_EGL_DEVICE_ID": " 1"}, "not an EGL device index"),
    ({"MUJOCO_EGL_DEVICE_ID": "\u0663"}, "not an EGL device index"),  # an Arabic-Indic digit: isdigit() but not ours
    ({"MUJOCO_EGL_DEVICE_ID": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, "robosuite 1.4 asserts at import"),
])
def test_a_users_device_robosuite_would_reject_is_one_line(environ, message) -> None:
    with pytest.raises(UserError) as caught:
        egl_device(environ)
    text = str(caught.value)
    assert message in text and "unset MUJOCO_EGL_DEVICE_ID" in text and "\n" not in text


def test_robosuites_import_assertion_accepts_what_it_accepts() -> None:
    """check_user_device passes exactly the values robosuite 1.4's assertion passes (its expression, copied)."""
    def robosuite_accepts(value: str, visible: str) -> bool:
        return visible == "" or (value.isdigit() and value in visible)

    for value, visible in [("0", "0"), ("1", "0,1"), ("3", ""), ("1", "GPU-1a2b"), ("2", "0,1"), ("10", "1,0")]:
        environ = {"MUJOCO_EGL_DEVICE_ID": value, "CUDA_VISIBLE_DEVICES": visible}
        try:
            egl.check_user_device(environ)
            ours = True
        except UserError:
            ours = False
        assert ours == robosuite_accepts(value, visible), (value, visible)


def test_the_real_seam_lists_what_mujoco_lists() -> None:
    """egl_devices() through ctypes against mujoco.egl's PyOpenGL enumeration (Mesa here: a software device, no CUDA
    attribute), in a fresh process: mujoco.egl fixes PYOPENGL_PLATFORM for the process that imports it."""
    code = ("import json\n"
            "from embodyhpc.sim.egl import egl_devices\n"
            "ours = egl_devices()\n"
            "from mujoco.egl import egl_ext\n"
            "print(json.dumps([len(ours), len(egl_ext.eglQueryDevicesEXT(max_devices=32)),"
            " [d.cuda_device for d in ours], [d.software for d in ours],"
            " ours[0].initialises() if ours else None]))\n")
    env = {**os.environ, "MUJOCO_GL": "egl"}
    env.pop("PYOPENGL_PLATFORM", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and "libEGL" in result.stderr:
        pytest.skip(f"no EGL on this machine: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr[-2000:]
    ours, mujocos, cuda_ids, software, first_initialises = json.loads(result.stdout)
    assert ours == mujocos >= 1
    if not any(c is not None for c in cuda_ids):  # no NVIDIA EGL here: Mesa's software device renders
        assert any(software) and first_initialises


@pytest.mark.slow
@pytest.mark.sim
def test_a_gpu_numbered_shard_renders_and_robosuites_assertion_holds() -> None:
    """CUDA_VISIBLE_DEVICES=3 as Slurm exports it without cgroups: the old choice ("3") is past EGL's list here and
    robosuite would assert on MUJOCO_EGL_DEVICE_ID=0 at import. The suite prints its choice and renders; the variable
    is not left in the environment for spawned workers."""
    code = ("import os\n"
            "from embodyhpc.eval.suites import make_suite\n"
            "with make_suite('libero', ['libero_spatial/0'], cameras=('image',), image_size=16,"
            " render_quality='fast') as s:\n"
            "    print(s.make_env('libero_spatial/0', 0, 0).reset()['observation.images.image'].shape)\n"
            "    print('left:', os.environ.get('MUJOCO_EGL_DEVICE_ID'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_EGL_DEVICE_ID", "PYOPENGL_PLATFORM")}
    result = subprocess.run([sys.executable, "-c", code], env={**env, "CUDA_VISIBLE_DEVICES": "3"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "libero: rendering on EGL device 0 of" in result.stdout
    assert "(16, 16, 3)" in result.stdout and "left: None" in result.stdout
