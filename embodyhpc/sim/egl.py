"""Which EGL device renders a simulator's cameras: the task's own GPU, never a neighbour's.

    choice = choose_egl_device(egl_devices(), task_cuda_device(os.environ))
    print(choice.describe())          # "EGL device 2 of 3: its EGL_CUDA_DEVICE_NV is 0, this task's CUDA device 0"

EGL numbers devices in its own order, not CUDA's (google-deepmind/mujoco issue 3245), and lists every GPU of the
node even where Slurm's cgroup lets the task open only its own: an index taken from SLURM_STEP_GPUS or
CUDA_VISIBLE_DEVICES renders on a neighbour's GPU, or fails to initialise (robosuite: "Cannot initialize a EGL device
display"). NVIDIA's EGL_NV_device_cuda extension says which CUDA device an EGL device is (EGL_CUDA_DEVICE_NV, an
ordinal in this process's CUDA numbering, i.e. after CUDA_VISIBLE_DEVICES; a GPU CUDA cannot see reports none). The
task's policy runs on its CUDA device 0, so the EGL device that reports 0 is the task's GPU. Else the first device
that initialises (Mesa's software device on CPU nodes, other vendors, old drivers), never another task's GPU before
a software device where the driver tells them apart (`choose_egl_device`).

`egl_devices()` is the only code here that calls libEGL (through ctypes, as mujoco.egl does): tests replace it with
a list of `EglDevice`s.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from embodyhpc.errors import RunFailure, UserError

EGL_CUDA_DEVICE_NV = 0x323A  # EGL_NV_device_cuda
EGL_EXTENSIONS = 0x3055
EGL_PLATFORM_DEVICE_EXT = 0x313F  # EGL_EXT_platform_device
EGL_TRUE = 1
MAX_DEVICES = 32
ROBOSUITE_MAX_DEVICES = 10  # robosuite 1.4 lists at most 10 EGL devices (mujoco.egl.eglQueryDevicesEXT's default)
SET_DEVICE_FIX = ("set MUJOCO_EGL_DEVICE_ID to the EGL device to render on, or install the EGL of the node's driver "
                  "(NVIDIA's libEGL_nvidia, or Mesa's: apt-get install libegl1 libegl-mesa0 libgl1-mesa-dri)")


@dataclass(frozen=True)
class EglDevice:
    """One entry of eglQueryDevicesEXT, at its index in that list."""

    cuda_device: int | None
    """EGL_CUDA_DEVICE_NV: the CUDA ordinal of this device in this process, None where the driver reports none."""
    software: bool
    """A software renderer (EGL_MESA_device_software): renders on CPUs, never on someone's GPU."""
    initialises: Callable[[], bool]
    """Whether eglInitialize succeeds on the device's platform display (asked only of the candidates)."""


@dataclass(frozen=True)
class EglChoice:
    index: int
    """The EGL device index (MUJOCO_EGL_DEVICE_ID)."""
    num_devices: int
    why: str

    def describe(self) -> str:
        return f"EGL device {self.index} of {self.num_devices}: {self.why}"


def task_cuda_device(environ: Mapping[str, str]) -> int | None:
    """The CUDA ordinal the task computes on: 0 (its first visible GPU), None in a job without GPUs
    (CUDA_VISIBLE_DEVICES set but empty, as our CPU jobs export it)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is not None and not visible.strip() else 0


def choose_egl_device(devices: Sequence[EglDevice], cuda_device: int | None) -> EglChoice:
    """The EGL device that is the task's CUDA device `cuda_device`, else the first that initialises, in an order that
    keeps off other tasks' GPUs: software devices first when the task has no GPU (`cuda_device` None); where some
    devices report CUDA ordinals (only GPUs this process's CUDA sees do), the task's other GPUs, then software
    devices, then the rest; where none does, EGL's order. A `RunFailure` naming what to set when none initialises."""
    num = len(devices)
    if num == 0:
        raise RunFailure(f"EGL lists no device to render on (fix: {SET_DEVICE_FIX})")
    matching = [i for i, d in enumerate(devices) if cuda_device is not None and d.cuda_device == cuda_device]
    for index in matching:
        if devices[index].initialises():
            return EglChoice(index, num, f"its EGL_CUDA_DEVICE_NV is {cuda_device}, this task's CUDA device "
                                         f"{cuda_device}")
    reports_cuda = any(d.cuda_device is not None for d in devices)

    def rank(index: int) -> int:
        device = devices[index]
        if cuda_device is None:
            return 0 if device.software else 1
        if reports_cuda:
            return 0 if device.cuda_device is not None else 1 if device.software else 2
        return 0

    for index in sorted(range(num), key=rank):  # stable: EGL's order within a rank
        if index not in matching and devices[index].initialises():
            if matching:
                why = f"the first that initialises (EGL device {matching[0]}, this task's CUDA device, does not)"
            elif cuda_device is None:
                why = "the first that initialises, software first (this task has no GPU: CUDA_VISIBLE_DEVICES='')"
            else:
                why = f"the first that initialises (no EGL device reports CUDA device {cuda_device})"
            return EglChoice(index, num, why)
    raise RunFailure(f"none of the {num} EGL device(s) initialises (fix: {SET_DEVICE_FIX})")


def check_user_device(environ: Mapping[str, str]) -> None:
    """A MUJOCO_EGL_DEVICE_ID the user set must be an index, and one robosuite 1.4 accepts: it asserts at import that
    the value is one of CUDA_VISIBLE_DEVICES (a substring of it, where that is set and not empty). A one-line
    `UserError` instead of robosuite's ValueError or AssertionError."""
    value, visible = environ.get("MUJOCO_EGL_DEVICE_ID"), environ.get("CUDA_VISIBLE_DEVICES", "")
    fix = "unset MUJOCO_EGL_DEVICE_ID to render on the EGL device of this task's own GPU"
    if value is None:
        return
    if not (value.isascii() and value.isdigit()):
        raise UserError(f"MUJOCO_EGL_DEVICE_ID={value!r} is not an EGL device index (a whole number)",
                        where="environment", fix=fix)
    if visible and value not in visible:
        raise UserError(f"MUJOCO_EGL_DEVICE_ID={value} is not among CUDA_VISIBLE_DEVICES={visible!r}, which robosuite "
                        "1.4 asserts at import", where="environment", fix=fix)


def render_device(environ: Mapping[str, str], *, max_index: int | None = None) -> EglChoice | None:
    """The EGL device to render on, or None where the choice is not ours: a MUJOCO_EGL_DEVICE_ID the user set (checked,
    kept) or a MUJOCO_GL other than EGL. `max_index`: the renderer looks at devices 0..max_index only."""
    if environ.get("MUJOCO_EGL_DEVICE_ID") is not None:
        check_user_device(environ)
        return None
    if environ.get("MUJOCO_GL", "egl").strip().lower() != "egl":
        return None
    choice = choose_egl_device(egl_devices(), task_cuda_device(environ))
    if max_index is not None and choice.index > max_index:
        raise RunFailure(f"the task's {choice.describe()}, but the renderer looks at EGL devices 0..{max_index} only "
                         "(fix: set MUJOCO_GL=osmesa to render on CPUs)")
    return choice


def egl_devices() -> list[EglDevice]:
    """The devices eglQueryDevicesEXT lists, in its order: the seam between this module and libEGL."""
    lib, proc = _libegl()
    query = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p),
                             ctypes.POINTER(ctypes.c_int32))(proc("eglQueryDevicesEXT"))
    attrib = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_void_p, ctypes.c_int32,
                              ctypes.POINTER(ctypes.c_ssize_t))(proc("eglQueryDeviceAttribEXT"))
    string = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_void_p, ctypes.c_int32)(proc("eglQueryDeviceStringEXT"))
    display_of = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p,
                                  ctypes.POINTER(ctypes.c_int32))(proc("eglGetPlatformDisplayEXT"))
    handles, count = (ctypes.c_void_p * MAX_DEVICES)(), ctypes.c_int32(0)
    if query(MAX_DEVICES, handles, ctypes.byref(count)) != EGL_TRUE:
        raise RunFailure(f"eglQueryDevicesEXT failed (EGL error {lib.eglGetError():#x}; fix: {SET_DEVICE_FIX})")

    def initialises(handle: int) -> bool:
        display = display_of(EGL_PLATFORM_DEVICE_EXT, handle, None)
        if not display or lib.eglGetError() != 0x3000:  # EGL_SUCCESS
            return False
        # Left initialised: the display is the process's one per device, the renderer's too (terminating it could
        # end a renderer's display), and only the chosen device is ever initialised (the probe stops there).
        return lib.eglInitialize(display, None, None) == EGL_TRUE

    devices = []
    for i in range(count.value):
        handle = handles[i]
        value = ctypes.c_ssize_t(-1)
        cuda = value.value if attrib(handle, EGL_CUDA_DEVICE_NV, ctypes.byref(value)) == EGL_TRUE else None
        lib.eglGetError()  # a device without EGL_NV_device_cuda leaves EGL_BAD_ATTRIBUTE behind: cleared
        extensions = (string(handle, EGL_EXTENSIONS) or b"").decode(errors="replace").split()
        devices.append(EglDevice(cuda_device=cuda, software="EGL_MESA_device_software" in extensions,
                                 initialises=lambda handle=handle: initialises(handle)))
    return devices


def _libegl() -> tuple[ctypes.CDLL, Callable[[str], int]]:
    name = ctypes.util.find_library("EGL") or "libEGL.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError as exc:
        raise RunFailure(f"libEGL cannot be loaded ({exc}; fix: {SET_DEVICE_FIX})") from exc
    lib.eglGetProcAddress.restype, lib.eglGetProcAddress.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    lib.eglInitialize.restype = ctypes.c_uint
    lib.eglInitialize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.eglGetError.restype, lib.eglGetError.argtypes = ctypes.c_int32, []

    def proc(symbol: str) -> int:
        address = lib.eglGetProcAddress(symbol.encode())
        if not address:
            raise RunFailure(f"libEGL ({name}) has no {symbol} (EGL_EXT_device_enumeration / EGL_EXT_platform_device;"
                             f" fix: {SET_DEVICE_FIX})")
        return address

    return lib, proc


__all__ = ["EGL_CUDA_DEVICE_NV", "ROBOSUITE_MAX_DEVICES", "EglChoice", "EglDevice", "check_user_device",
           "choose_egl_device", "egl_devices", "render_device", "task_cuda_device"]
