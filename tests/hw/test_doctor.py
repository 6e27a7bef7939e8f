"""run_doctor end to end on fake nodes: NVML stub + fake sysfs + fake mount table + tmp_path NVMe."""

from __future__ import annotations

import json
import os
import sys

import pytest

from embodyhpc.config.network import NetworkConfig
from embodyhpc.errors import UserError
from embodyhpc.hw import DoctorOptions, NoGpuBackend, Status, nodes_to_exclude, open_gpu_backend, run_doctor
from tests.helpers import require
from tests.hw import fake_sysfs as fs
from tests.hw import nvml_stub
from tests.hw.nvml_stub import make_nvml

NODE = {"SLURMD_NODENAME": "gpu-017"}


@pytest.fixture
def node(tmp_path):
    """Paths of a fake node: sysfs root, mount table with a Lustre runs root, an xfs NVMe folder."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text("overlay / overlay rw 0 0\n"
                      "10.10.0.1@o2ib:/scratch /lustre lustre rw,flock 0 0\n"
                      f"/dev/md0 {os.path.realpath(nvme)} xfs rw,noatime 0 0\n")

    def options(**overrides) -> DoctorOptions:
        values = dict(runs_root="/lustre/runs", nvme_path=str(nvme), nvme_probe_bytes=256 << 10,
                      nvme_min_write_mb_s=0.001, expected_gpus=8, num_nodes=4, sysfs_root=str(tmp_path / "sys"),
                      mounts_path=str(mounts), probe_torch=False)
        return DoctorOptions(**{**values, **overrides})

    return tmp_path / "sys", options


def _gpus(gpus):
    return open_gpu_backend(make_nvml(gpus))


def test_healthy_ib_node_is_ready(node):
    sysfs, options = node
    fs.ndr_ib_node(sysfs)
    report = run_doctor(options(), gpu_backend=_gpus(nvml_stub.healthy(8)), environ=NODE)
    assert report.status is Status.OK and report.exit_code() == 0, report.to_text()
    assert [c.name for c in report.checks] == ["gpus", "ib", "runs_fs", "nvme", "nccl_env"]
    text = report.to_text()
    assert text.startswith("embodyhpc doctor on node gpu-017: ok") and text.endswith("node gpu-017 is ready")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["hostname"] == "gpu-017" and data["exclude"] is None and data["exit_code"] == 0
    assert data["runs_fs"]["kind"] == "lustre" and data["nvme"]["fstype"] == "xfs"
    assert len(data["gpus"]) == 8 and data["ib_ports"][0]["name"] == "mlx5_0:1"
    assert data["driver_version"] == "550.54.15"


def test_ecc_node_says_which_node_to_exclude(node):
    sysfs, options = node
    fs.ndr_ib_node(sysfs)
    report = run_doctor(options(), gpu_backend=_gpus(nvml_stub.with_ecc_errors(3, 12)), environ=NODE)
    assert report.exit_code() == 1 and [c.name for c in report.failed] == ["gpu3.ecc"]
    text = report.to_text()
    assert "FAIL  gpu3.ecc" in text and "GPU 3: 12 uncorrected ECC errors (volatile" in text
    assert text.splitlines()[-1].startswith("EXCLUDE THIS NODE: gpu-017 (sbatch --exclude=gpu-017)")
    assert report.to_dict()["exclude"] == "gpu-017"
    healthy = run_doctor(options(), gpu_backend=_gpus(nvml_stub.healthy(8)), environ={"SLURMD_NODENAME": "gpu-002"})
    assert nodes_to_exclude([healthy, json.loads(json.dumps(report.to_dict()))]) == ["gpu-017"]


def test_port_down_fails_when_the_profile_lists_the_rail(node):
    sysfs, options = node
    fs.port_down_node(sysfs)
    network = NetworkConfig(fabric="ib", hcas=["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"])
    report = run_doctor(options(), network=network, gpu_backend=_gpus(nvml_stub.healthy(8)), environ=NODE)
    assert [(c.name, c.reason) for c in report.failed] == [("ib.mlx5_2:1", "mlx5_2 port 1 is DOWN "
                                                            "(phys Polling: no cable or no peer)")]
    # inside a job the same rails arrive as NCCL_IB_HCA
    in_job = run_doctor(options(), gpu_backend=_gpus(nvml_stub.healthy(8)),
                        environ={**NODE, **network.environment()})
    assert [c.name for c in in_job.failed] == ["ib.mlx5_2:1"]


def test_roce_node_with_profile_and_a_clashing_shell_variable(node):
    sysfs, options = node
    fs.roce_v2_node(sysfs)
    network = NetworkConfig(fabric="roce", hcas=["mlx5_0:1", "mlx5_1:1"], gid_index=3)
    env = {**NODE, "NCCL_IB_GID_INDEX": "1", "NCCL_DEBUG": "WARN"}
    report = run_doctor(options(), network=network, gpu_backend=_gpus(nvml_stub.healthy(8)), environ=env)
    assert report.exit_code() == 0
    clash = [c for c in report.checks if c.name == "nccl_env"][0]
    assert clash.status is Status.WARN and "NCCL_IB_GID_INDEX=1 (profile: 3)" in clash.reason
    assert report.nccl_env == {"NCCL_DEBUG": "WARN", "NCCL_IB_GID_INDEX": "1"}


def test_node_without_gpu_or_ib_reports_plainly(node):
    _, options = node
    backend = NoGpuBackend("NVML did not start: NVML Shared Library Not Found")
    report = run_doctor(options(expected_gpus=None, num_nodes=1), gpu_backend=backend, environ=NODE)
    assert report.exit_code() == 0 and report.status is Status.WARN
    text = report.to_text()
    assert "no GPU visible (NVML did not start: NVML Shared Library Not Found)" in text
    assert "no InfiniBand/RoCE devices" in text and "can run the job" in text
    strict = run_doctor(options(), network=NetworkConfig(fabric="ib"), gpu_backend=backend, environ=NODE)
    assert {c.name for c in strict.failed} == {"gpus", "ib"}


def test_broken_driver_is_a_failed_check_not_a_crash(node):
    _, options = node

    class Broken(NoGpuBackend):
        def health(self):
            raise RuntimeError("NVML: Unknown Error")

    report = run_doctor(options(), gpu_backend=Broken(), environ=NODE)
    assert [(c.name, c.reason) for c in report.failed] == [("gpus", "NVML query failed: NVML: Unknown Error")]


def test_full_nvme_and_local_runs_root_fail(node):
    _, options = node
    report = run_doctor(options(runs_root="/opt/runs", nvme_required_bytes=10**18),
                        gpu_backend=_gpus(nvml_stub.healthy(8)), environ=NODE)
    assert {c.name for c in report.failed} == {"runs_fs", "nvme"}
    assert any("staging needs 1000000.0 TB" in c.reason for c in report.failed)


def test_default_backend_is_nvml_and_is_closed(node, monkeypatch):
    _, options = node
    stub = make_nvml(nvml_stub.healthy(8))
    monkeypatch.setitem(sys.modules, "pynvml", stub)
    report = run_doctor(options(), environ=NODE)
    assert report.gpu_backend == "nvml" and len(report.gpus) == 8
    with pytest.raises(stub.NVMLError):
        stub.nvmlDeviceGetCount()  # nvmlShutdown ran


def test_versions_check_flags_cpu_torch_on_a_gpu_node(node):
    require("torch", "train")
    _, options = node
    report = run_doctor(options(probe_torch=True), gpu_backend=_gpus(nvml_stub.healthy(8)), environ=NODE)
    versions = [c for c in report.checks if c.name == "versions"][0]
    if report.versions["cuda"] == "n/a":
        assert versions.status is Status.WARN and "CPU build of torch on a GPU node" in versions.reason
    assert "driver 550.54.15" in versions.reason


def test_bad_gid_index_variable_and_bad_options(node):
    sysfs, options = node
    fs.roce_v2_node(sysfs)
    report = run_doctor(options(), gpu_backend=_gpus(nvml_stub.healthy(8)), environ={**NODE, "NCCL_IB_GID_INDEX": "x"})
    assert any(c.name == "nccl_env" and c.status is Status.WARN for c in report.checks)
    auto = run_doctor(options(), gpu_backend=_gpus(nvml_stub.healthy(8)), environ={**NODE, "NCCL_IB_GID_INDEX": "-1"})
    assert [c.reason for c in auto.checks if c.status is not Status.OK] == []  # -1: NCCL's default, no warning
    with pytest.raises(UserError, match="doctor.num_nodes"):
        DoctorOptions(num_nodes=0)


def test_out_of_range_nccl_variables_on_the_node_are_a_warning(node):
    """A node whose shell profile exports values NCCL would mask or misread (the job inherits them)."""
    _, options = node
    env = {**NODE, "NCCL_IB_RETRY_CNT": "10", "NCCL_IB_TIMEOUT": "022", "NCCL_DEBUG": "WARN"}
    report = run_doctor(options(), gpu_backend=_gpus(nvml_stub.healthy(8)), environ=env)
    check = [c for c in report.checks if c.name == "nccl_env"][0]
    assert check.status is Status.WARN and report.exit_code() == 0
    assert "NCCL_IB_RETRY_CNT=10 is out of range: 0-7" in check.reason
    assert "NCCL_IB_TIMEOUT='022' is not a plain decimal integer" in check.reason


def _scoped(node_options, recipe_overrides, *, local):
    """DoctorOptions for a shipped recipe (hw.recipe_scope), on the fake node."""
    import dataclasses

    from embodyhpc.hw import recipe_scope
    from embodyhpc.validation import load_recipe

    config = load_recipe("smoke_cpu", ["job.runs_root=/opt/runs", *recipe_overrides]).config
    options, network, skipped = recipe_scope(config, local=local)
    fake = node_options()
    return dataclasses.replace(options, sysfs_root=fake.sysfs_root, mounts_path=fake.mounts_path,
                               probe_torch=False, nvme_probe_bytes=0), network, skipped


def test_doctor_recipe_judges_only_what_the_recipe_uses(node):
    _, node_options = node
    broken = _gpus(nvml_stub.healthy(0))
    # smoke_cpu: 2 nodes, no GPUs, staging off; its runs root on the node's overlay root filesystem
    options, network, skipped = _scoped(node_options, [], local=True)
    report = run_doctor(options, network=network, gpu_backend=broken, environ=NODE)
    assert report.exit_code() == 0 and not report.failed, report.to_text()  # runs_fs: overlay warns, fine
    assert "nvme" not in {c.name for c in report.checks} and "gpus" not in {c.name for c in report.checks}
    assert [line.split(":")[0] for line in skipped] == ["gpus", "nvme", "runs_fs", "network"]
    # the same recipe submitted to a cluster: 2 nodes need a shared runs root, and that is still a failure
    options, network, skipped = _scoped(node_options, [], local=False)
    report = run_doctor(options, network=network, gpu_backend=broken, environ=NODE)
    assert {c.name for c in report.failed} == {"runs_fs"} and network is not None
    # staging on: the NVMe folder is judged (it does not exist here)
    options, _, _ = _scoped(node_options, ["staging.enabled=true", "staging.nvme_dir=/nonexistent/nvme",
                                           "data.format=lerobot", "data.root=/tmp"], local=True)
    assert options.nvme_path == "/nonexistent/nvme"
    report = run_doctor(options, gpu_backend=broken, environ=NODE)
    assert {c.name for c in report.failed} == {"nvme"}


def test_doctor_command_judges_a_run_here_without_slurm(cli, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch: submit would run the chain here, so doctor judges that
    result = cli("doctor", "smoke_cpu", "--json", "--probe-mb", "0", f"job.runs_root={tmp_path}")
    data = json.loads(result.out)
    assert "judged for a run on this machine" in result.err
    assert {c["name"] for c in data["checks"]}.isdisjoint({"nvme", "gpus"})
    assert all(c["status"] != "fail" for c in data["checks"] if c["name"] == "runs_fs")
    assert any(line.startswith("nvme: not checked") for line in data["not_judged"])
