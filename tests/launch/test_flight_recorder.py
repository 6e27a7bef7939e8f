"""The flight recorder's size reaches the process group under the one name the running torch reads, and its dumps
go into the run directory.

torch 2.8 renamed TORCH_NCCL_TRACE_BUFFER_SIZE to TORCH_FR_BUFFER_SIZE and warns on every rank that finds the old
name; torch before 2.8 reads only the old one. Sbatch scripts no longer export it: the job sets it before the
process group is created (launch/distributed.py, with parallel/flight_recorder.py), translating a user's setting
instead of adding a second one.
The dump file (TORCH_FR_DUMP_TEMP_FILE, before TORCH_NCCL_DEBUG_INFO_TEMP_FILE) is set the same way, to
logs/flight-recorder/<job id>/rank_ of the run, so that a hang's traces outlive the node's /tmp.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embodyhpc.launch import distributed
from embodyhpc.launch.distributed import DistEnv
from embodyhpc.parallel.flight_recorder import (
    FR_BUFFER_NEW,
    FR_BUFFER_OLD,
    FR_DUMP_NEW,
    FR_DUMP_OLD,
    flight_recorder_dump_variable,
    flight_recorder_variable,
    set_flight_recorder_dump_file,
    set_flight_recorder_size,
)
from embodyhpc.rundir import FLIGHT_RECORDER_DIR, flight_recorder_prefix
from embodyhpc.validation import load_recipe

REPO = Path(__file__).resolve().parents[2]
DUMP = "TORCH_NCCL_DUMP_ON_TIMEOUT"


@pytest.mark.parametrize(("version", "name"), [
    ("2.6.0+cu124", FR_BUFFER_OLD), ("2.7.1", FR_BUFFER_OLD), ("2.7.1+cpu", FR_BUFFER_OLD),
    ("2.8.0", FR_BUFFER_NEW), ("2.8.0a0+git5e4bd59", FR_BUFFER_NEW), ("2.10.1", FR_BUFFER_NEW),  # not "2.10" < "2.8"
    ("2.13.0+cpu", FR_BUFFER_NEW), ("3.0.0", FR_BUFFER_NEW), ("1.13.1", FR_BUFFER_OLD)])
def test_the_name_each_torch_reads(version, name):
    assert flight_recorder_variable(version) == name


def test_the_installed_torch_reads_the_new_name():
    """torch 2.13 (the CI pin) reads TORCH_FR_BUFFER_SIZE: its process-group code names it first."""
    assert flight_recorder_variable(torch.__version__) == FR_BUFFER_NEW
    source = Path(torch.distributed.distributed_c10d.__file__).read_text()
    assert source.index(f'"{FR_BUFFER_NEW}"') < source.index(f'"{FR_BUFFER_OLD}"')


NEW, OLD = "2.13.0+cpu", "2.7.1+cu126"
CASES = [  # (torch version, environment before, the flight-recorder part after)
    (NEW, {DUMP: "1"}, {FR_BUFFER_NEW: "2000"}),
    (OLD, {DUMP: "1"}, {FR_BUFFER_OLD: "2000"}),
    (NEW, {DUMP: "true"}, {FR_BUFFER_NEW: "2000"}),
    (NEW, {DUMP: "1", FR_BUFFER_OLD: "500"}, {FR_BUFFER_NEW: "500"}),  # the user's old name, translated
    (OLD, {DUMP: "1", FR_BUFFER_NEW: "500"}, {FR_BUFFER_OLD: "500"}),  # the user's new name on an old torch
    (NEW, {FR_BUFFER_OLD: "0"}, {FR_BUFFER_NEW: "0"}),  # turned off stays off
    (NEW, {DUMP: "1", FR_BUFFER_NEW: "100", FR_BUFFER_OLD: "500"}, {FR_BUFFER_NEW: "100"}),  # as torch >= 2.8 would
    (OLD, {DUMP: "1", FR_BUFFER_NEW: "100", FR_BUFFER_OLD: "500"}, {FR_BUFFER_OLD: "500"}),  # as torch < 2.8 would
    (NEW, {}, {}),
    (NEW, {DUMP: "0"}, {}),
]


@pytest.mark.parametrize(("version", "before", "after"), CASES)
def test_one_name_translated_never_both(version, before, after):
    environ = {"PATH": "/usr/bin", **before}
    name = set_flight_recorder_size(environ, version)
    assert {k: v for k, v in environ.items() if k in (FR_BUFFER_NEW, FR_BUFFER_OLD)} == after
    assert name == (next(iter(after)) if after else None)
    assert environ["PATH"] == "/usr/bin" and environ.get(DUMP) == before.get(DUMP)


def test_rendered_scripts_no_longer_export_a_buffer_size():
    env = load_recipe("smoke_cpu").config.network.environment()
    assert env[DUMP] == "1" and FR_BUFFER_NEW not in env and FR_BUFFER_OLD not in env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_rank() -> DistEnv:
    return DistEnv(rank=0, local_rank=0, world_size=1, node_rank=0, num_nodes=1, master_addr="127.0.0.1",
                   master_port=_free_port(), job_id="test", hostnames=("localhost",))


@pytest.mark.parametrize(("version", "kept", "gone"), [(OLD, FR_BUFFER_OLD, FR_BUFFER_NEW),
                                                       (NEW, FR_BUFFER_NEW, FR_BUFFER_OLD)])
def test_the_process_group_sees_the_name_of_its_torch(monkeypatch, version, kept, gone):
    """A real (gloo, one rank) process group; torch's version faked for the old-torch case."""
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setenv(DUMP, "1")
    monkeypatch.setenv(gone, "1234")  # the user wrote the other torch's name
    monkeypatch.setenv(kept, "")  # recorded, so that the name process_group sets is removed after the test
    monkeypatch.delenv(kept)
    seen: dict[str, str] = {}
    real_init = torch.distributed.init_process_group

    def init_and_look(*args, **kwargs):
        seen.update(os.environ)
        return real_init(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "init_process_group", init_and_look)
    with distributed.process_group(_one_rank(), backend="gloo"):
        assert torch.distributed.get_world_size() == 1
    assert seen[kept] == "1234" and gone not in seen


@pytest.mark.slow  # a fresh python that imports torch and opens a gloo group: 1.9-2.3 s alone
def test_no_deprecation_warning_from_the_process_group():
    """torch 2.13 warns on stderr when a process group finds TORCH_NCCL_TRACE_BUFFER_SIZE (it does so on CPU and
    gloo too): the job's process group must not. A fresh process, since torch reads the variable once."""
    code = ("import torch, torch.distributed as dist\n"
            "from embodyhpc.launch.distributed import DistEnv, process_group\n"
            "env = DistEnv(0, 0, 1, 0, 1, '127.0.0.1', int(__import__('sys').argv[1]), 'job', ('localhost',))\n"
            "with process_group(env, backend='gloo'):\n"
            "    t = torch.ones(2); dist.all_reduce(t); assert t.tolist() == [1.0, 1.0]\n"
            "print('ok')\n")
    env = {**os.environ, DUMP: "1", FR_BUFFER_OLD: "2000"}  # as the sbatch scripts exported it before
    env.pop(FR_BUFFER_NEW, None)
    proc = subprocess.run([sys.executable, "-c", code, str(_free_port())], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
    assert "deprecated" not in proc.stderr and FR_BUFFER_OLD not in proc.stderr, proc.stderr


# ---- where the flight recorder dumps: the run directory ----
@pytest.fixture
def no_dump_variables(monkeypatch):
    """The job sets the dump variable in os.environ; record both names so that the test leaves neither behind."""
    for name in (FR_DUMP_NEW, FR_DUMP_OLD):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


@pytest.mark.parametrize(("version", "name"), [
    ("2.6.0+cu124", FR_DUMP_OLD), ("2.8.0", FR_DUMP_OLD), ("2.9.0", FR_DUMP_NEW), ("2.10.1", FR_DUMP_NEW),
    ("2.13.0+cpu", FR_DUMP_NEW), ("3.0.0", FR_DUMP_NEW)])
def test_the_dump_file_name_each_torch_reads(version, name):
    assert flight_recorder_dump_variable(version) == name


@pytest.mark.slow
def test_the_installed_torch_reads_both_dump_names_the_new_one_first():
    """torch 2.13 (the CI pin) reads the prefix in C++ (FlightRecorder.cpp: getCvarString({TORCH_FR_DUMP_TEMP_FILE,
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE}, ...)); the names are in its library, the new one first."""
    import mmap

    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    with library.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        new, old = data.find(f"{FR_DUMP_NEW}\0".encode()), data.find(f"{FR_DUMP_OLD}\0".encode())
    assert flight_recorder_dump_variable(torch.__version__) == FR_DUMP_NEW and new >= 0 and old >= 0


RUN_PREFIX = "/runs/exp/r-20250101-000000/logs/flight-recorder/77/rank_"
DUMP_CASES = [  # (torch version, environment before, the dump part after)
    (NEW, {}, {FR_DUMP_NEW: RUN_PREFIX}),
    (OLD, {}, {FR_DUMP_OLD: RUN_PREFIX}),
    (NEW, {FR_DUMP_NEW: "/scratch/me/fr_"}, {FR_DUMP_NEW: "/scratch/me/fr_"}),  # the user's, kept
    (NEW, {FR_DUMP_OLD: "/scratch/me/fr_"}, {FR_DUMP_NEW: "/scratch/me/fr_"}),  # translated
    (OLD, {FR_DUMP_NEW: "/scratch/me/fr_"}, {FR_DUMP_OLD: "/scratch/me/fr_"}),
    (NEW, {FR_DUMP_NEW: "/a/", FR_DUMP_OLD: "/b/"}, {FR_DUMP_NEW: "/a/"}),  # as torch >= 2.9 would
    (OLD, {FR_DUMP_NEW: "/a/", FR_DUMP_OLD: "/b/"}, {FR_DUMP_OLD: "/b/"}),  # as torch < 2.9 would
    (NEW, {FR_DUMP_NEW: ""}, {FR_DUMP_NEW: RUN_PREFIX}),  # empty: torch would dump into the working directory
]


@pytest.mark.parametrize(("version", "before", "after"), DUMP_CASES)
def test_dumps_go_to_the_run_unless_the_user_said_where(version, before, after, monkeypatch):
    made = []
    monkeypatch.setattr(Path, "mkdir", lambda self, parents=False, exist_ok=False: made.append(self))
    environ = {"PATH": "/usr/bin", DUMP: "1", **before}
    name = set_flight_recorder_dump_file(environ, version, Path(RUN_PREFIX))
    assert {k: v for k, v in environ.items() if k in (FR_DUMP_NEW, FR_DUMP_OLD)} == after and name in after
    assert environ["PATH"] == "/usr/bin" and environ[DUMP] == "1"
    assert made == ([Path(RUN_PREFIX).parent] if after[name] == RUN_PREFIX else [])  # the user's folder: theirs


@pytest.mark.parametrize(("job_id", "folder"), [("77", "77"), ("4242_3", "4242_3"), ("../../etc", "_.._etc"),
                                                ("..", "job"), ("", "job"), ("a b/c", "a_b_c")])
def test_one_dump_folder_per_job_inside_the_run(tmp_path, job_id, folder):
    prefix = flight_recorder_prefix(tmp_path, job_id)
    assert prefix == tmp_path / FLIGHT_RECORDER_DIR / folder / "rank_"
    assert prefix.resolve().is_relative_to((tmp_path / FLIGHT_RECORDER_DIR).resolve())


def test_the_process_group_dumps_into_the_run_directory(monkeypatch, tmp_path, no_dump_variables):
    """A real (gloo, one rank) process group of job "test": torch is handed the run's folder, which exists."""
    monkeypatch.setenv(DUMP, "1")
    monkeypatch.setenv(FR_BUFFER_NEW, "")
    monkeypatch.delenv(FR_BUFFER_NEW)
    seen: dict[str, str] = {}
    real_init = torch.distributed.init_process_group

    def init_and_look(*args, **kwargs):
        seen.update(os.environ)
        return real_init(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "init_process_group", init_and_look)
    with distributed.process_group(_one_rank(), backend="gloo", run_dir=tmp_path):
        assert torch.distributed.get_world_size() == 1
    prefix = tmp_path / "logs" / "flight-recorder" / "test" / "rank_"
    assert seen[FR_DUMP_NEW] == str(prefix) and FR_DUMP_OLD not in seen and prefix.parent.is_dir()


def test_a_dump_file_the_user_set_reaches_the_process_group(monkeypatch, tmp_path, no_dump_variables):
    monkeypatch.setenv(FR_DUMP_OLD, str(tmp_path / "mine_"))  # the old name, from a site's env
    seen: dict[str, str] = {}
    real_init = torch.distributed.init_process_group

    def init_and_look(*args, **kwargs):
        seen.update(os.environ)
        return real_init(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "init_process_group", init_and_look)
    with distributed.process_group(_one_rank(), backend="gloo", run_dir=tmp_path / "run"):
        pass
    assert seen[FR_DUMP_NEW] == str(tmp_path / "mine_") and FR_DUMP_OLD not in seen
    assert not (tmp_path / "run").exists()


def test_the_training_job_points_the_dumps_into_its_run(fake_cuda, monkeypatch, tmp_path, no_dump_variables):
    """train_task down to init_process_group (tests/launch/test_train_device.py's double): job 77's ranks dump
    under the run directory the job was given (what the job exported is still in its environment there)."""
    from tests.launch.test_train_device import _train_task_until_the_process_group

    cuda = fake_cuda(2)
    _train_task_until_the_process_group(cuda, monkeypatch, tmp_path, local_rank=1)
    assert cuda.events[-1][0] == "init_process_group"
    prefix = tmp_path / FLIGHT_RECORDER_DIR / "77" / "rank_"
    assert os.environ[FR_DUMP_NEW] == str(prefix) and prefix.parent.is_dir() and FR_DUMP_OLD not in os.environ
