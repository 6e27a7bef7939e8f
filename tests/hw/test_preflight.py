"""The in-job preflight on fake nodes: NVML stub + fake sysfs + tmp_path NVMe and checkpoint folders."""

from __future__ import annotations

import json

import pytest

from embodyhpc.config.network import NetworkConfig
from embodyhpc.config.schema import Config, DataConfig, ResourcesConfig, StagingConfig
from embodyhpc.errors import RunFailure
from embodyhpc.hw import NoGpuBackend, Status, nodes_to_exclude, open_gpu_backend
from embodyhpc.hw.preflight import NodeUnhealthy, preflight, run_preflight_for_job, scan_size
from tests.hw import fake_sysfs as fs
from tests.hw import nvml_stub
from tests.hw.nvml_stub import FakeGpu, make_nvml

IB = NetworkConfig(fabric="ib", hcas=["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"])


@pytest.fixture
def node(tmp_path):
    """A callable running the preflight of an 8-GPU IB node against tmp_path folders."""
    sysfs, nvme, logs = tmp_path / "sys", tmp_path / "nvme", tmp_path / "run" / "logs"

    def run(gpus=None, *, network=IB, gpus_per_node=8, staging=True, node_name="gpu-017", **kwargs):
        backend = kwargs.pop("gpu_backend", None) or open_gpu_backend(make_nvml(gpus or nvml_stub.healthy(8)))
        return preflight(ResourcesConfig(gpus_per_node=gpus_per_node), network,
                         StagingConfig(enabled=staging, nvme_dir=str(nvme)), kwargs.pop("data", DataConfig()),
                         node=node_name, checkpoint_dir=kwargs.pop("checkpoint_dir", tmp_path / "run" / "checkpoints"),
                         logs_dir=logs, gpu_backend=backend, sysfs_root=sysfs, **kwargs)

    return run, sysfs, logs


@pytest.fixture
def imports(monkeypatch) -> list[str]:
    """Every module name imported (by an import statement) while the test runs: the preflight's cost is what it
    does, and the slow parts it leaves out on purpose (torch's ~2 s of imports, the write-speed probe's module)
    are named here, not timed."""
    import builtins

    names: list[str] = []
    real = builtins.__import__

    def recording(name, *args, **kwargs):
        names.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", recording)
    return names


def _report(logs, name="gpu-017"):
    return json.loads((logs / f"preflight-{name}.json").read_text())


def test_healthy_ib_node_passes_quickly_and_writes_its_report(node, imports):
    run, sysfs, logs = node
    fs.ndr_ib_node(sysfs)
    result = run(dataset_bytes=10 << 20)
    assert not [name for name in imports if name.split(".")[0] in ("torch", "numpy")]  # quickly: no torch probe
    assert result.status is Status.OK, result.checks
    assert [c.name for c in result.checks] == ["gpus", "ib", "nvme", "checkpoint_dir"]
    assert result.gpu_count == 8 and result.elapsed_s >= 0
    data = _report(logs)
    assert data["hostname"] == "gpu-017" and data["status"] == "ok" and data["exclude"] is None
    assert data["dataset_bytes"] == 10 << 20 and data["staged_bytes"] == 0
    assert not list((logs.parent / "checkpoints").iterdir())  # the write probe cleaned up


def test_ecc_errors_fail_naming_the_node_to_exclude(node):
    run, sysfs, logs = node
    fs.ndr_ib_node(sysfs)
    run_dir = logs.parent
    with pytest.raises(NodeUnhealthy) as caught:
        run(nvml_stub.with_ecc_errors(3, 12), run_dir=run_dir)
    error = caught.value
    assert isinstance(error, RunFailure) and error.node == "gpu-017"
    message = str(error)
    assert message.startswith("node gpu-017 failed the preflight: gpu3.ecc: GPU 3: 12 uncorrected ECC errors")
    # the exact command that goes on without the node, pasteable as printed
    assert f"embodyhpc resume {run_dir} --exclude gpu-017 " in message
    assert "preflight-gpu-017.json" in message and "\n" not in message
    data = _report(logs)
    assert data["status"] == "fail" and data["exclude"] == "gpu-017"
    assert [c["name"] for c in data["checks"] if c["status"] == "fail"] == ["gpu3.ecc"]
    assert nodes_to_exclude([data]) == ["gpu-017"]


def test_rail_of_the_profile_down_fails(node):
    run, sysfs, logs = node
    fs.port_down_node(sysfs)
    with pytest.raises(NodeUnhealthy, match=r"ib\.mlx5_2:1: mlx5_2 port 1 is DOWN .* site\.exclude=\[gpu-017\]"):
        run(dataset_bytes=0)
    # without raising, the result says the same
    result = run(dataset_bytes=0, raise_on_failure=False)
    assert [c.name for c in result.failed] == ["ib.mlx5_2:1"]


def test_node_without_gpu_or_rdma_passes_plainly_when_the_recipe_needs_neither(node, tmp_path):
    run, sysfs, logs = node
    backend = NoGpuBackend("NVML did not start: NVML Shared Library Not Found")
    result = run(gpu_backend=backend, network=NetworkConfig(), gpus_per_node=0, staging=False)
    assert result.status is Status.OK and result.gpu_count == 0
    reasons = {c.name: c.reason for c in result.checks}
    assert reasons["gpus"] == "no GPU requested (resources.gpus_per_node=0); none visible"
    assert reasons["ib"].startswith("no InfiniBand/RoCE devices") and set(reasons) == {"gpus", "ib", "checkpoint_dir"}


def test_this_machine_with_the_default_backend_and_real_sysfs(tmp_path, imports):
    """No fakes: NVML (or its absence) and /sys/class/infiniband of the machine running the tests."""
    result = preflight(ResourcesConfig(), NetworkConfig(), StagingConfig(), DataConfig(), node="here",
                       checkpoint_dir=tmp_path / "ckpt", logs_dir=tmp_path / "logs")
    assert not [name for name in imports if name.split(".")[0] in ("torch", "numpy")]
    assert result.status is not Status.FAIL
    assert (tmp_path / "logs" / "preflight-here.json").is_file()


def test_gpu_count_mismatch_and_missing_gpus_fail(node):
    run, sysfs, _ = node
    fs.ndr_ib_node(sysfs)
    with pytest.raises(NodeUnhealthy, match="gpus: 4 x NVIDIA H100 80GB HBM3, .*the job expects 8 GPUs"):
        run(nvml_stub.healthy(4))
    with pytest.raises(NodeUnhealthy, match=r"gpus: no GPU visible \(no NVIDIA GPU\), the job expects 8"):
        run(gpu_backend=NoGpuBackend())


def test_retired_pages_over_the_limit_fail_in_a_job(node):
    run, sysfs, _ = node
    fs.ndr_ib_node(sysfs)
    gpus = nvml_stub.healthy(8)
    gpus[5] = FakeGpu(name="Tesla V100-SXM2-32GB", remapped_rows=None, retired_pages={0: list(range(50)),
                                                                                     1: list(range(15))})
    with pytest.raises(NodeUnhealthy, match=r"gpu5\.pages: GPU 5: 65 retired pages \(limit 60\)"):
        run(gpus, dataset_bytes=0)


def test_nvme_without_room_for_the_dataset_fails(node, tmp_path):
    run, sysfs, _ = node
    fs.ndr_ib_node(sysfs)
    with pytest.raises(NodeUnhealthy, match=r"nvme: NVMe .* free, staging needs 1020000\.0 TB"):  # 2 % margin
        run(dataset_bytes=10**18)


def test_dataset_size_comes_from_a_bounded_scan(node, tmp_path):
    run, sysfs, logs = node
    fs.ndr_ib_node(sysfs)
    root = tmp_path / "dataset"
    (root / "data" / "chunk-000").mkdir(parents=True)
    (root / "meta").mkdir()
    (root / "data" / "chunk-000" / "file-000.parquet").write_bytes(b"x" * 3000)
    (root / "meta" / "info.json").write_bytes(b"{}")
    assert scan_size(root) == (3002, "5 entries, 3.0 kB")
    size, why = scan_size(root, max_entries=2)
    assert size is None and "stopped after 2 entries" in why
    run(data=DataConfig(format="lerobot", root=str(root)))
    assert _report(logs)["dataset_bytes"] == 3002
    result = run(data=DataConfig(format="synthetic"))
    nvme = [c for c in result.checks if c.name == "nvme"][0]
    assert nvme.status is Status.OK and "dataset size unknown (synthetic data)" in nvme.reason


def test_unwritable_checkpoint_folder_fails(node, tmp_path):
    run, sysfs, _ = node
    fs.ndr_ib_node(sysfs)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(NodeUnhealthy, match=r"checkpoint_dir: cannot write to the checkpoint folder .*file/ckpt"):
        run(dataset_bytes=0, checkpoint_dir=blocker / "ckpt")


def test_job_hook_runs_on_local_rank_zero_only(tmp_path):
    config = Config()
    assert config.resources.preflight is True
    assert run_preflight_for_job(tmp_path, config, local_rank=1, node="n1") is None
    assert not (tmp_path / "logs").exists()
    result = run_preflight_for_job(tmp_path, config, local_rank=0, node="n1")
    assert result is not None and result.status is not Status.FAIL
    assert json.loads((tmp_path / "logs" / "preflight-n1.json").read_text())["hostname"] == "n1"
    off = Config(resources=ResourcesConfig(preflight=False))
    assert run_preflight_for_job(tmp_path, off, local_rank=0, node="n2") is None
    assert not (tmp_path / "logs" / "preflight-n2.json").exists()


def test_staging_room_counts_every_dataset_of_a_mixture(node, tmp_path, monkeypatch):
    import os
    import shutil
    from collections import namedtuple

    from embodyhpc.config.coerce import build

    run, sysfs, logs = node
    fs.ndr_ib_node(sysfs)
    sizes = {"a": 300_000, "b": 5_000_000}
    for name, size in sizes.items():
        (tmp_path / name / "data").mkdir(parents=True)
        (tmp_path / name / "data" / "file-000.parquet").write_bytes(b"x" * size)
    total = sum(os.path.getsize(p) for name in sizes for p in (tmp_path / name).rglob("*") if p.is_file())
    allocated = -(-total // 4096) * 4096
    needed = allocated + 256 * 1024 * 1024 + int(0.02 * allocated)  # staging's margin: 256 MiB and 2 %
    data = build(DataConfig, {"format": "lerobot", "datasets": [{"root": str(tmp_path / "a"), "weight": 3},
                                                                {"root": str(tmp_path / "b")}]}, "data.")
    usage = namedtuple("usage", "total used free")
    for free, fails in ((needed - 1, True), (needed, False)):
        monkeypatch.setattr(shutil, "disk_usage", lambda path, free=free: usage(10 * needed, 0, free))
        result = run(data=data, raise_on_failure=False)
        assert _report(logs)["dataset_bytes"] == total == 5_300_000
        nvme = [c for c in result.checks if c.name == "nvme"][0]
        assert (nvme.status is Status.FAIL) is fails, nvme.reason
