"""`embodyhpc data synth` and `data info` with bad arguments: one `error:` line naming the option and the fix, exit 2,
and nothing written (no folder, no parent folder, the current folder untouched); a recording that fails later removes
what it made. Limits are cli/data_checks.py's; the expected messages are written here, not read from the code."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import one_line_error, require

SYNTH = ("data", "synth")
MT50_SIZE = 50


def _tree(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): None if p.is_dir() or p.is_symlink() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def here(tmp_path, monkeypatch) -> Path:
    """An empty current folder: `--out ''` or `.` would write into it."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _refused(cli, root: Path, args: tuple[str, ...], *fragments: str) -> str:
    before = _tree(root)
    line = one_line_error(cli(*SYNTH, *args), *fragments, "(fix: ")
    assert "Traceback" not in line
    assert _tree(root) == before, "a refused synth wrote something"
    return line


# ---- numbers out of range ----
NUMBERS = {
    "episodes 0": (("--episodes", "0"), "--episodes", ">= 1"),
    "episodes -1": (("--episodes", "-1"), "--episodes", "got -1"),
    "episodes above the limit": (("--episodes", "100001"), "--episodes", "<= 100000"),
    "episodes huge": (("--episodes", "99999999999999999999"), "--episodes", "<= 100000"),
    "episodes x tasks above a million": (("--tasks", "MT50", "--episodes", "100000"), "--episodes",
                                         f"{MT50_SIZE} tasks x 100000 episodes"),
    "image size 0": (("--image-size", "0"), "--image-size", "even number of pixels"),
    "image size negative": (("--image-size", "-64"), "--image-size", "got -64"),
    "image size odd": (("--image-size", "63"), "--image-size", "use 64"),
    "image size 1": (("--image-size", "1"), "--image-size", "got 1"),
    "image size above 1024": (("--image-size", "1026"), "--image-size", "2 to 1024"),
    "image size huge": (("--image-size", "1000000000"), "--image-size", "2 to 1024"),
    "seed negative": (("--seed", "-1"), "--seed", ">= 0"),
    "seed 2**31": (("--seed", str(2**31)), "--seed", "<= 2147483647"),
    "seed huge": (("--seed", str(10**30)), "--seed", "<= 2147483647"),
    "workers 0": (("--workers", "0"), "--workers", ">= 1"),
    "workers -5": (("--workers", "-5"), "--workers", "got -5"),
    "max steps negative": (("--max-steps", "-1"), "--max-steps", ">= 0"),
    "max steps huge": (("--max-steps", "10001"), "--max-steps", "<= 10000"),
}


@pytest.mark.parametrize("case", sorted(NUMBERS))
def test_numbers_out_of_range_are_one_line_and_write_nothing(cli, here, case):
    args, option, fragment = NUMBERS[case]
    _refused(cli, here, ("--out", "ds", *args), f"error: {option}: ", fragment)


# ---- names: tasks, cameras, simulator, policy, suite options ----
NAMES = {
    "tasks only commas": (("--tasks", ",,,"), "--tasks", "names no task"),
    "tasks blank": (("--tasks", " , "), "--tasks", "names no task"),
    "tasks empty": (("--tasks", ""), "--tasks", "names no task"),
    "tasks empty name between": (("--tasks", "reach-v3,,push-v3"), "--tasks", "empty task name"),
    "tasks trailing comma": (("--tasks", "reach-v3,"), "--tasks", "empty task name"),
    "task twice": (("--tasks", "reach-v3,push-v3,reach-v3"), "--tasks", "'reach-v3' named more than once"),
    "task twice with spaces": (("--tasks", "reach-v3, reach-v3"), "--tasks", "named more than once"),
    "task also in a group": (("--tasks", "MT10,push-v3"), "--tasks", "push-v3 named more than once"),
    "two groups overlapping": (("--tasks", "MT10,MT50"), "--tasks", "named more than once"),
    "tasks with a newline": (("--tasks", "reach-v3\npush-v3"), "--tasks", "control character"),
    "unknown task": (("--tasks", "reach-v3,reach-v9"), "--tasks", "unknown MetaWorld tasks ['reach-v9']"),
    "task in the wrong case": (("--tasks", "Reach-v3"), "--tasks", "did you mean 'reach-v3'?"),
    "pusht task twice": (("--env", "pusht", "--policy", "random", "--tasks", "pusht,pusht"), "--tasks",
                         "named more than once"),
    "unknown pusht task": (("--env", "pusht", "--policy", "random", "--tasks", "push-t"), "--tasks",
                           "unknown PushT tasks"),
    "libero without tasks": (("--env", "libero", "--policy", "random"), "--tasks", "name the tasks"),
    "cameras only a comma": (("--cameras", ","), "--cameras", "names no camera"),
    "unknown camera": (("--cameras", "nocam"), "--cameras", "unknown MetaWorld camera 'nocam'"),
    "camera in the wrong case": (("--cameras", "Corner"), "--cameras", "did you mean 'corner'?"),
    "camera twice": (("--cameras", "corner,corner2,corner"), "--cameras", "'corner' named more than once"),
    "camera with a tab": (("--cameras", "corner\tcorner2"), "--cameras", "control character"),
    "pusht camera": (("--env", "pusht", "--policy", "random", "--tasks", "pusht", "--cameras", "corner"),
                     "--cameras", "unknown PushT camera 'corner'"),
    "libero camera": (("--env", "libero", "--policy", "random", "--tasks", "libero_spatial/0", "--cameras",
                       "image,wrist"), "--cameras", "did you mean 'wrist_image'?"),
    "unknown simulator": (("--env", "metaworl"), "--env", "did you mean 'metaworld'?"),
    "empty simulator": (("--env", ""), "--env", "unknown simulator ''"),
    "simulator with a newline": (("--env", "pusht\n"), "--env", "'pusht\\n'"),
    "unknown policy": (("--policy", "Expert"), "--policy", "did you mean 'expert'?"),
    "option without =": (("--option", "video_size"), "--option", "not an option of the metaworld suite"),
    "unknown option": (("--option", "bogus=1"), "--option", "video_camera"),
    "option without a value": (("--option", "video_size="), "--option", "has no value"),
    "option twice": (("--option", "video_size=64", "--option", "video_size=96"), "--option", "more than once"),
}


@pytest.mark.parametrize("case", sorted(NAMES))
def test_bad_names_are_one_line_and_write_nothing(cli, here, case):
    args, option, fragment = NAMES[case]
    _refused(cli, here, ("--out", "ds", *args), f"error: {option}: ", fragment)


def test_an_unknown_task_lists_every_valid_one(cli, here):
    from embodyhpc.eval.task_names import METAWORLD_TASKS

    line = _refused(cli, here, ("--out", "ds", "--tasks", "reach"), "--tasks")
    assert all(task in line for task in (*METAWORLD_TASKS, "MT10", "MT50"))


# ---- the output folder ----
def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o500)
        return folder / "ds"
    if os.access("/proc/sys", os.W_OK):  # root writes anywhere but on a read-only mount
        pytest.skip("running as root and /proc/sys is writable here: no folder this test could not write to")
    return Path("/proc/sys/embodyhpc-never-written")


def _symlink(tmp_path: Path) -> Path:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    return tmp_path / "link"


def _file(tmp_path: Path) -> Path:
    (tmp_path / "notes.txt").write_text("mine")
    return tmp_path / "notes.txt"


def _full(tmp_path: Path) -> Path:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "thesis.tex").write_text("mine")
    return tmp_path / "full"


def _under_a_file(tmp_path: Path) -> Path:
    return _file(tmp_path) / "ds"


def _under_a_broken_link(tmp_path: Path) -> Path:
    (tmp_path / "gone").symlink_to(tmp_path / "never-made")
    return tmp_path / "gone" / "ds"


OUT = {
    "empty": (lambda t: "", "empty path"),
    "blank": (lambda t: "   ", "empty path"),
    "newline": (lambda t: "d\ns", "'d\\ns'"),
    "tab in a parent": (lambda t: "a\tb/ds", "control or unprintable character"),
    "escape character": (lambda t: "ds\x1b[31m", "control or unprintable character"),
    "trailing space": (lambda t: "ds ", "starts or ends with a space"),
    "name of 256 bytes": (lambda t: "d" * 256, "folder name of 256 bytes"),
    "name of 240 bytes (no room for --overwrite's sibling)": (lambda t: "d" * 240, "leave room"),
    "multibyte name of 300 bytes": (lambda t: "é" * 150, "folder name of 300 bytes"),
    "path above PATH_MAX": (lambda t: "/".join(["d" * 200] * 21), "absolute path is"),
    "a file": (lambda t: str(_file(t)), "exists and is not a folder"),
    "a symbolic link": (lambda t: str(_symlink(t)), "a symbolic link"),
    "a non-empty folder": (lambda t: str(_full(t)), "pass --overwrite"),
    "under a file": (lambda t: str(_under_a_file(t)), "is a file, not a folder"),
    "under a broken link": (lambda t: str(_under_a_broken_link(t)), "a broken link, not a folder"),
    "unwritable": (lambda t: str(_unwritable(t)), "not writable"),
}


@pytest.mark.parametrize("case", sorted(OUT))
def test_bad_out_is_one_line_and_nothing_is_made(cli, here, case):
    make, fragment = OUT[case]
    out = make(here)
    line = _refused(cli, here, ("--out", out), "error: ", "--out: ", fragment)
    assert len(line) < 2000


def test_overwrite_refuses_a_folder_that_is_not_a_dataset(cli, here):
    full = _full(here)
    _refused(cli, here, ("--out", str(full), "--overwrite"), "--out: ", "--overwrite refused", "thesis.tex")


def test_the_out_checks_are_the_writers(tmp_path):
    """A library caller of LeRobotWriter gets the same refusals (the writer runs check_output_dir)."""
    from embodyhpc.data import DatasetError
    from embodyhpc.data.writer import LeRobotWriter

    features = {"action": {"dtype": "float32", "shape": [2]}}
    for bad, fragment in ((tmp_path / "d\nx", "control"), (tmp_path / ("d" * 256), "256 bytes"),
                          (_file(tmp_path) / "ds", "not a folder")):
        with pytest.raises(DatasetError, match=fragment):
            LeRobotWriter(bad, fps=10, features=features)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_video_needs_two_pixels_a_side():
    from embodyhpc.data.writer import LeRobotWriter

    for shape in ([0, 0, 3], [0, 64, 3], [64, 1, 3]):
        with pytest.raises(ValueError, match=">= 2 pixels|even height"):
            LeRobotWriter("/never/written", fps=10, features={"observation.images.c": {"dtype": "video",
                                                                                        "shape": shape}})


# ---- what is accepted, and what is only warned about ----
def _check(tmp_path: Path, **changes):
    from embodyhpc.cli.data_checks import check_synth

    args = dict(out=str(tmp_path / "ds"), env="metaworld", tasks=None, episodes=5, image_size=64, seed=0,
                cameras=None, workers=1, policy="expert", max_steps=0, options=[], overwrite=False)
    return check_synth(**{**args, **changes})


def test_accepted_values_and_defaults(tmp_path):
    request = _check(tmp_path)
    assert request.tasks == ["reach-v3", "push-v3", "pick-place-v3", "door-open-v3"] and request.cameras == ["corner"]
    assert request.metaworld_expert and request.workers == 1 and request.warnings == []
    request = _check(tmp_path, tasks=" MT10 , peg-unplug-side-v3", cameras="", image_size=1024, seed=2**31 - 1,
                     episodes=90_000)  # 990000 episodes in all: under the million
    assert _check(tmp_path, tasks="reach-v3", episodes=100_000).tasks == ["reach-v3"]
    assert len(request.tasks) == 11 and request.tasks[-1] == "peg-unplug-side-v3" and request.cameras == []
    assert len(_check(tmp_path, tasks="mt50").tasks) == MT50_SIZE
    request = _check(tmp_path, options=["video_size=-2", "video_camera=corner2"], max_steps=10_000, image_size=2)
    assert request.options == {"video_size": -2, "video_camera": "corner2"} and not request.metaworld_expert
    (tmp_path / "empty").mkdir()
    assert _check(tmp_path, out=str(tmp_path / "empty")).out == tmp_path / "empty"
    assert _check(tmp_path, out=str(tmp_path / "new" / "parents" / "ds")).tasks
    assert _check(tmp_path, out=str(tmp_path / ("d" * 231))).out.name == "d" * 231
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # checking made nothing


def test_workers_above_the_cpus_are_capped_with_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    request = _check(tmp_path, workers=64)
    assert request.workers == 3
    assert request.warnings == ["--workers 64 is more than the 3 CPUs this process may use: using 3"]
    assert _check(tmp_path, workers=3).warnings == []
    request = _check(tmp_path, workers=2, policy="random")
    assert request.workers == 1 and "--workers 2 is ignored" in request.warnings[0]


def test_a_suite_refusal_is_one_line(cli, here):
    """A suite checks what only it knows (PushT's camera, an option's value) before anything is written."""
    for args, fragment in ((("--env", "libero", "--tasks", "libero_spatial/0", "--policy", "random", "--cameras",
                             "image2,wrist_image"), "once each"),  # two names of the same wrist camera
                           (("--env", "pusht", "--tasks", "pusht", "--policy", "replay"), "cannot run the replay")):
        result = cli(*SYNTH, "--out", "ds", *args)
        assert result.code == 2 and fragment in result.err and len(result.err.strip().splitlines()) == 1, result.err
    assert list(here.iterdir()) == []


# ---- a recording that fails leaves nothing behind ----
def test_a_failed_recording_removes_the_folders_it_made(tmp_path):
    from embodyhpc.cli.data_checks import no_half_made

    from embodyhpc.data.output_dir import WRITING_MARKER

    def fail_while_writing(out: Path, error: type[BaseException] = KeyboardInterrupt) -> None:
        with pytest.raises(error), no_half_made(out):
            out.mkdir(parents=True, exist_ok=True)
            (out / WRITING_MARKER).touch()
            (out / "data").mkdir()
            raise error()

    fail_while_writing(tmp_path / "a" / "b" / "ds")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "empty").mkdir()
    fail_while_writing(tmp_path / "empty", RuntimeError)
    assert [p.name for p in tmp_path.iterdir()] == ["empty"] and list((tmp_path / "empty").iterdir()) == []
    (tmp_path / "kept" / "sub").mkdir(parents=True)  # a parent that existed stays
    fail_while_writing(tmp_path / "kept" / "sub" / "new" / "ds")
    assert _tree(tmp_path) == {"empty": None, "kept": None, "kept/sub": None}


def test_a_failure_leaves_a_folder_that_is_not_the_writers_alone(tmp_path):
    from embodyhpc.cli.data_checks import no_half_made

    from embodyhpc.data.output_dir import WRITING_MARKER

    theirs = tmp_path / "theirs"
    with pytest.raises(RuntimeError), no_half_made(theirs):
        theirs.mkdir()  # made meanwhile by something else: no marker of the writer
        (theirs / "x").write_text("x")
        raise RuntimeError
    unfinished = tmp_path / "unfinished"  # an unfinished dataset from before, which --overwrite would replace
    unfinished.mkdir()
    (unfinished / WRITING_MARKER).touch()
    (unfinished / "data").mkdir()
    with pytest.raises(RuntimeError), no_half_made(unfinished):
        raise RuntimeError
    assert _tree(tmp_path) == {"theirs": None, "theirs/x": b"x", "unfinished": None, "unfinished/data": None,
                               f"unfinished/{WRITING_MARKER}": b""}


@pytest.mark.slow
@pytest.mark.sim
def test_synth_with_no_successful_episode_is_one_line_and_leaves_nothing(cli, here, monkeypatch):
    require("metaworld", "sim")
    monkeypatch.setenv("MUJOCO_GL", os.environ.get("MUJOCO_GL", "egl"))
    (here / "empty").mkdir()
    for out in ("new/parent/ds", "empty"):
        result = cli(*SYNTH, "--out", out, "--tasks", "reach-v3", "--episodes", "1", "--max-steps", "3",
                     "--cameras", "")
        assert result.code == 1, result.err
        lines = result.err.strip().splitlines()
        assert len(lines) == 1 and "none of the 1 expert episodes succeeded within 3 steps" in lines[0], result.err
    assert _tree(here) == {"empty": None}


@pytest.mark.slow
@pytest.mark.sim
def test_the_library_refuses_the_same_arguments_before_writing(tmp_path):
    require("metaworld", "sim")
    from embodyhpc.errors import UserError
    from embodyhpc.sim.metaworld import generate_demos

    out = tmp_path / "never"
    for kwargs, key, fragment in (
            ({"tasks": ["reach-v3", "reach-v3"]}, "tasks", "named more than once"),
            ({"cameras": ["corner", "nope"]}, "cameras", "unknown camera 'nope'"),
            ({"cameras": ["corner", "corner"]}, "cameras", "repeated camera"),
            ({"image_size": 0}, "image_size", "even number >= 2"),
            ({"image_size": 63}, "image_size", "got 63"),
            ({"num_workers": 0}, "num_workers", ">= 1"),
            ({"seed": -1}, "seed", "0..4294967295"),
            ({"seed": 2**32 - 1, "episodes_per_task": 51}, "seed", "up to 4294967296"),
            ({"episodes_per_task": 0}, "episodes_per_task", ">= 1")):
        with pytest.raises(UserError, match=fragment) as caught:
            generate_demos(out, **{"tasks": ["reach-v3"], "progress": False, **kwargs})
        assert caught.value.key == key
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.sim
def test_every_metaworld_model_has_the_cameras_synth_accepts():
    require("metaworld", "sim")
    import mujoco
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS

    from embodyhpc.eval.task_names import METAWORLD_CAMERAS
    from embodyhpc.sim.metaworld import CAMERAS

    assert CAMERAS == METAWORLD_CAMERAS  # the simulator-free list the CLI checks --cameras against

    for task in ("reach-v3", "assembly-v3", "window-close-v3"):
        env = ALL_V3_ENVIRONMENTS[task]()
        try:
            names = {mujoco.mj_id2name(env.model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(env.model.ncam)}
        finally:
            env.close()
        assert names == set(CAMERAS), task


# ---- data info ----
def _h5(path: Path, layout) -> Path:
    h5py = require("h5py", "data")
    with h5py.File(path, "w") as f:
        layout(f)
    return path


def _lerobot(path: Path, info, tasks: bool = False) -> Path:
    (path / "meta").mkdir(parents=True)
    (path / "meta" / "info.json").write_text(info if isinstance(info, str) else json.dumps(info))
    if tasks:
        (path / "meta" / "tasks.parquet").write_text("not parquet")
    return path


_INFO = {"codebase_version": "v3.0", "features": {"action": {"dtype": "float32", "shape": [2]}}, "fps": 10,
         "total_episodes": 1, "total_frames": 1}
INFO_CASES = {
    "empty path": (lambda t: "", "PATH: empty path"),
    "blank path": (lambda t: " ", "PATH: empty path"),
    "newline in a missing path": (lambda t: "a\nb", "'a\\nb' does not exist"),
    "missing": (lambda t: str(t / "nope"), "does not exist"),
    "not HDF5": (lambda t: str(_file(t)), "not HDF5"),
    "corrupt HDF5": (lambda t: (t / "x.h5").write_text("junk") and str(t / "x.h5"), "cannot open as HDF5"),
    "HDF5 without data": (lambda t: str(_h5(t / "e.h5", lambda f: f.create_group("other"))), "no 'data' group"),
    "HDF5 demo without actions": (lambda t: str(_h5(t / "g.h5", lambda f: f.create_group("data/demo_0"))),
                                  "data/demo_0 has no 'actions'"),
    "folder without meta": (lambda t: str(_full(t)), "no meta/info.json"),
    "info.json garbage": (lambda t: str(_lerobot(t / "d", "{")), "invalid JSON"),
    "info.json a list": (lambda t: str(_lerobot(t / "d", "[]")), "a JSON list, not an object"),
    "info.json without features": (lambda t: str(_lerobot(t / "d", {"codebase_version": "v3.0"})),
                                   "missing features, fps"),
    "features a list": (lambda t: str(_lerobot(t / "d", {**_INFO, "features": []})), "must map each feature"),
    "no tasks.parquet": (lambda t: str(_lerobot(t / "d", _INFO)), "tasks.parquet: file missing"),
    "tasks.parquet garbage": (lambda t: str(_lerobot(t / "d", _INFO, tasks=True)), "cannot read parquet"),
    "info.json a folder": (lambda t: (t / "d" / "meta" / "info.json").mkdir(parents=True) or str(t / "d"),
                           "cannot read"),
}


@pytest.mark.parametrize("case", sorted(INFO_CASES))
def test_data_info_on_what_is_not_a_dataset_is_one_line(cli, here, case):
    make, fragment = INFO_CASES[case]
    path = make(here)
    before = _tree(here)
    line = one_line_error(cli("data", "info", path), fragment)
    assert "Traceback" not in line and _tree(here) == before
