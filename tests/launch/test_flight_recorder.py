"""The flight recorder's size reaches the process group under the one name the running torch reads.

torch 2.8 renamed TORCH_NCCL_TRACE_BUFFER_SIZE to TORCH_FR_BUFFER_SIZE and warns on every rank that finds the old
name; torch before 2.8 reads only the old one. Sbatch scripts no longer export it: the job sets it before the
process group is created (launch/distributed.py), translating a user's setting instead of adding a second one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from embodyhpc.config.load import load_recipe
from embodyhpc.launch import distributed
from embodyhpc.launch.distributed import (
    FR_BUFFER_NEW,
    FR_BUFFER_OLD,
    DistEnv,
    flight_recorder_variable,
    set_flight_recorder_size,
)

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
