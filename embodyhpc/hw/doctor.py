"""`embodyhpc doctor`: one node's hardware preflight, as a report with ok/warn/fail checks.

Run by hand on a node, or as the first step of every training job on every node: a job on a
thousand GPUs dies of its one bad node (ECC errors, a rail down, a full NVMe), so the report says
plainly which node to exclude. The CLI only prints `DoctorReport.to_text()` / `to_dict()` and exits
with `exit_code()`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from embodyhpc.config import nccl_values
from embodyhpc.config.network import NetworkConfig
from embodyhpc.config.schema import Config
from embodyhpc.errors import ConfigError, UserError
from embodyhpc.hw import report
from embodyhpc.hw.checks import Check, Status, fail, ok, warn, worst
from embodyhpc.hw.gpu import GpuBackend, GpuHealth, check_gpus, open_gpu_backend
from embodyhpc.hw.ib import DEFAULT_SYSFS_ROOT, IbPort, read_ib_ports
from embodyhpc.hw.ib_checks import check_ib
from embodyhpc.hw.storage import NvmeInfo, check_nvme, check_runs_root, probe_nvme
from embodyhpc.hw.versions import NOT_AVAILABLE, exported_nccl_env, torch_versions
from embodyhpc.mounts import Mount, read_mounts


@dataclass(frozen=True)
class DoctorOptions:
    """What to check and against which expectations. Everything not set is reported, not judged."""

    runs_root: str | None = None
    """Runs/checkpoint root; its filesystem must be shared when num_nodes > 1."""
    nvme_path: str | None = None
    """Node-local staging directory (site profile); None skips the NVMe checks."""
    nvme_required_bytes: int | None = None
    """Bytes staging will write there; less free space fails the node."""
    nvme_probe_bytes: int = 64 << 20
    """Size of the write+fsync speed probe; 0 skips it. 64 MiB takes well under a second on NVMe."""
    nvme_min_write_mb_s: float = 200.0
    """Below this the probe warns: a healthy NVMe writes GB/s, a few hundred MB/s means a failing disk or a
    network mount."""
    expected_gpus: int | None = None
    """GPUs per node the job asks for; a different count fails the node."""
    num_nodes: int = 1
    """Nodes in the job: more than one needs a shared runs root."""
    temperature_warn_c: int = 85
    """GPU temperature that warns at preflight time (an idle GPU this hot has a cooling problem)."""
    sysfs_root: str = str(DEFAULT_SYSFS_ROOT)
    """Where RDMA devices are listed; tests point it at a fake tree."""
    mounts_path: str = "/proc/mounts"
    """The mount table to classify filesystems with."""
    probe_torch: bool = True
    """Import torch to report its CUDA and NCCL versions (~2 s)."""
    judge_gpus: bool = True
    """False for a job that uses no GPU: the GPUs are listed, never a warning or failure."""

    def __post_init__(self) -> None:
        for name in ("nvme_probe_bytes", "expected_gpus", "nvme_required_bytes"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise UserError(f"must be >= 0, got {value}", key=f"doctor.{name}")
        if self.num_nodes < 1:
            raise UserError(f"must be >= 1, got {self.num_nodes}", key="doctor.num_nodes")


@dataclass
class DoctorReport:
    hostname: str
    checks: list[Check]
    gpu_backend: str = "none"
    gpu_note: str = ""
    driver_version: str | None = None
    gpus: list[GpuHealth] = field(default_factory=list)
    ib_ports: list[IbPort] = field(default_factory=list)
    runs_fs: Mount | None = None
    nvme: NvmeInfo | None = None
    versions: dict[str, str] = field(default_factory=dict)
    nccl_env: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def status(self) -> Status:
        return worst(self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    def exit_code(self) -> int:
        """0 when the node may run the job (ok or warnings only), 1 when it must be excluded."""
        return 1 if self.failed else 0

    def to_dict(self) -> dict:
        return report.to_dict(self)

    def to_text(self) -> str:
        return report.to_text(self)


def recipe_scope(config: Config, *, local: bool = False, **options) -> tuple[DoctorOptions, NetworkConfig | None,
                                                                             list[str]]:
    """What of this node a recipe uses: the DoctorOptions and network profile to judge it by, and one line for each
    part left unjudged and why (`doctor RECIPE` prints them). `options` are further DoctorOptions fields.

    A run on this machine (`local`: `submit --local`, or no Slurm controller answering, when submit runs it here
    too) has its nodes as processes of one machine: its runs root need not be shared, and its network profile is
    not used. The NVMe folder matters only when the recipe stages its dataset there."""
    skipped: list[str] = []
    fields: dict = {"runs_root": config.job.runs_root, "expected_gpus": config.resources.gpus_per_node or None,
                    "num_nodes": 1 if local else config.resources.nodes}
    if not config.resources.gpus_per_node:
        fields["judge_gpus"] = False
        skipped.append("gpus: not judged, the recipe uses none (resources.gpus_per_node=0)")
    if config.staging.enabled:
        fields["nvme_path"] = config.staging.nvme_dir
    else:
        skipped.append("nvme: not checked, the recipe does not stage its dataset (staging.enabled=false)")
    if local and config.resources.nodes > 1:
        skipped.append(f"runs_fs: judged for a run on this machine ({config.resources.nodes} nodes as local "
                       "processes), which needs no shared filesystem")
    if local:
        skipped.append("network: the recipe's network profile is not judged for a run on this machine")
    return DoctorOptions(**{**fields, **options}), None if local else config.network, skipped


def _node_name(environ: Mapping[str, str]) -> str:
    # Slurm's own node name is what `--exclude` takes; it can differ from the host name
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def run_doctor(options: DoctorOptions | None = None, *, network: NetworkConfig | None = None,
               gpu_backend: GpuBackend | None = None, environ: Mapping[str, str] | None = None,
               hostname: str | None = None) -> DoctorReport:
    """Check this node. `network` is the site profile's section (its rails and GID index are then required);
    without it, the exported NCCL_IB_* variables say what the job uses. `gpu_backend` defaults to NVML."""
    options = options or DoctorOptions()
    env = dict(os.environ if environ is None else environ)
    start = time.perf_counter()
    result = DoctorReport(hostname=hostname or _node_name(env), checks=[], nccl_env=exported_nccl_env(env))
    checks = result.checks

    backend = gpu_backend or open_gpu_backend()
    try:
        result.gpu_backend, result.gpu_note = backend.name, backend.note
        result.driver_version = backend.driver_version()
        result.gpus = backend.health()
        if options.judge_gpus:
            checks += check_gpus(backend, result.gpus, options.expected_gpus, options.temperature_warn_c)
    except Exception as exc:  # a broken driver is a verdict on the node, not a crash
        if options.judge_gpus:
            checks.append(fail("gpus", f"NVML query failed: {exc}"))
    finally:
        if gpu_backend is None:
            backend.close()

    result.ib_ports = read_ib_ports(options.sysfs_root)
    checks += _check_network(result.ib_ports, network, env, options.sysfs_root)

    mounts: list[Mount] = []
    if options.runs_root or options.nvme_path:
        try:
            mounts = read_mounts(options.mounts_path)
        except OSError as exc:
            checks.append(warn("mounts", f"cannot read {options.mounts_path}: {exc}"))
    if options.runs_root:
        result.runs_fs, check = check_runs_root(options.runs_root, mounts, options.num_nodes)
        checks.append(check)
    if options.nvme_path:
        result.nvme = probe_nvme(options.nvme_path, mounts, options.nvme_probe_bytes)
        checks += check_nvme(result.nvme, options.nvme_required_bytes, options.nvme_min_write_mb_s)

    if options.probe_torch:
        result.versions = torch_versions()
        checks.append(_check_versions(result.versions, result.driver_version, bool(result.gpus)))
    checks += _check_env(result.nccl_env, network)
    result.elapsed_s = time.perf_counter() - start
    return result


def _check_network(ports: list[IbPort], network: NetworkConfig | None, env: Mapping[str, str],
                   root: str) -> list[Check]:
    if network is not None:
        return check_ib(ports, hcas=network.hcas or None, fabric=network.fabric, gid_index=network.gid_index,
                        ib_disabled=network.fabric == "ethernet", from_profile=True, root=root)
    gid_text = env.get("NCCL_IB_GID_INDEX")
    gid_index = int(gid_text) if gid_text and gid_text.strip().isdigit() else None
    checks = check_ib(ports, hcas=env.get("NCCL_IB_HCA") or None, gid_index=gid_index,
                      ib_disabled=env.get("NCCL_IB_DISABLE") == "1", root=root)
    if gid_text and gid_index is None and gid_text.strip() != "-1":  # -1: NCCL's default, it picks the GID
        checks.append(warn("nccl_env", f"NCCL_IB_GID_INDEX={gid_text!r} is not a GID table index"))
    return checks


def _check_versions(versions: dict[str, str], driver: str | None, has_gpus: bool) -> Check:
    line = (f"torch {versions['torch']}, CUDA {versions['cuda']}, NCCL {versions['nccl']}, "
            f"driver {driver or NOT_AVAILABLE}")
    if versions["torch"] == "not installed":
        return warn("versions", f"{line}: the job's environment needs torch")
    if has_gpus and versions["cuda"] == NOT_AVAILABLE:
        return warn("versions", f"{line}: a CPU build of torch on a GPU node")
    return ok("versions", line)


def _check_env(nccl_env: dict[str, str], network: NetworkConfig | None) -> list[Check]:
    misread = []  # values NCCL would clamp, mask or read as something else (embodyhpc.config.nccl_values)
    for name, value in nccl_env.items():
        try:
            nccl_values.check_value(name, value, name)
        except ConfigError as exc:
            misread.append(exc.message)
    if misread:
        return [warn("nccl_env", "exported values NCCL does not take as written: " + "; ".join(misread))]
    if network is None:
        names = ", ".join(nccl_env) or "none"
        return [ok("nccl_env", f"exported NCCL/Gloo variables: {names}")]
    # inside a job these variables come from the profile; a different value means the doctor runs in a shell
    # with hand-tuned NCCL settings, or the job was launched with another profile: either way, someone should look
    clashes = [f"{k}={mine} (profile: {theirs})" for k, (mine, theirs) in network.conflicts(nccl_env).items()]
    if clashes:
        return [warn("nccl_env", f"exported values differ from the network profile: {'; '.join(clashes)}")]
    return [ok("nccl_env", f"exported NCCL/Gloo variables agree with the network profile ({len(nccl_env)} set)")]
