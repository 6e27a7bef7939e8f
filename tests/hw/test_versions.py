"""torch/CUDA/NCCL versions (real CPU torch, and fake CUDA builds) and the exported NCCL variables."""

from __future__ import annotations

import sys
import types

import pytest

from embodyhpc.hw.versions import exported_nccl_env, torch_versions
from tests.helpers import require


def test_exported_variables_are_filtered_and_sorted():
    env = {"PATH": "/usr/bin", "NCCL_IB_HCA": "mlx5", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
           "GLOO_SOCKET_IFNAME": "eth0", "NCCL_DEBUG": "WARN", "MY_NCCL_THING": "x", "TORCH_HOME": "/t"}
    assert list(exported_nccl_env(env).items()) == [
        ("GLOO_SOCKET_IFNAME", "eth0"), ("NCCL_DEBUG", "WARN"), ("NCCL_IB_HCA", "mlx5"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")]


def test_cpu_torch_has_no_nccl():
    torch = require("torch", "train")
    if torch.version.cuda:
        pytest.skip("a CUDA build of torch")
    assert torch_versions() == {"torch": torch.__version__, "cuda": "n/a", "nccl": "n/a"}


def _fake_torch(nccl_version):
    def version():
        if isinstance(nccl_version, Exception):
            raise nccl_version
        return nccl_version
    return types.SimpleNamespace(__version__="2.7.1+cu126", version=types.SimpleNamespace(cuda="12.6"),
                                 cuda=types.SimpleNamespace(nccl=types.SimpleNamespace(version=version)))


@pytest.mark.parametrize("reported, text", [((2, 26, 2), "2.26.2"), (21805, "2.18.5"), (2708, "2.7.8")])
def test_cuda_build_reports_nccl(monkeypatch, reported, text):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(reported))
    assert torch_versions() == {"torch": "2.7.1+cu126", "cuda": "12.6", "nccl": text}


def test_nccl_query_failure_and_missing_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(RuntimeError("libnccl.so.2 not found")))
    assert torch_versions()["nccl"] == "n/a (libnccl.so.2 not found)"
    monkeypatch.setitem(sys.modules, "torch", None)
    assert torch_versions() == {"torch": "not installed", "cuda": "n/a", "nccl": "n/a"}
