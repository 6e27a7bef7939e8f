"""In-job preflight: the doctor checks that decide whether a node may run the job, in well under a second.

Local rank 0 of every node runs it before the process group starts (`run_preflight_for_job`). A failing
node writes `logs/preflight-<node>.json` and raises `NodeUnhealthy`, whose one-line message names the node
and the exact `embodyhpc resume RUN --exclude <node>` that goes on without it, so the job fails in seconds
instead of hanging in NCCL or dying hours later. What it judges:

- GPUs: present, as many as `resources.gpus_per_node` (when > 0), none lost, no uncorrected volatile ECC
  errors, no pending page retirement or row remapping, fewer retired pages than NVIDIA's replacement limit;
- RDMA: the profile's HCAs (`network.hcas`) ACTIVE, with the right link layer and RoCE v2 GID entry;
- staging: the node-local NVMe folder has room for what is left to copy of the dataset (data.root, or every
  dataset of a mixture, data.datasets), when that is known (scans that stop after SCAN_BUDGET_S in all /
  SCAN_MAX_ENTRIES each);
- checkpoints: the checkpoint folder accepts a file from this node.

Left out on purpose (the doctor still reports them): the NVMe write-speed probe, the torch/NCCL version
probe (~2 s of imports), and the runs-root "shared filesystem" rule, which a single-host test cluster breaks.
A node without GPUs and RDMA ports passes plainly when the recipe asks for neither.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embodyhpc.errors import RunFailure
from embodyhpc.hw.checks import Check, Status, fail, human_bytes, ok, worst
from embodyhpc.hw.gpu import GpuBackend, check_gpus, open_gpu_backend
from embodyhpc.hw.ib import DEFAULT_SYSFS_ROOT, read_ib_ports
from embodyhpc.hw.ib_checks import check_ib
from embodyhpc.hw.storage import NvmeInfo, check_nvme

if TYPE_CHECKING:
    from embodyhpc.config.network import NetworkConfig
    from embodyhpc.config.schema import Config, DataConfig, ResourcesConfig, StagingConfig

SCAN_BUDGET_S = 0.25
"""The dataset-size scan gives up (size unknown, check skipped) after this long..."""
SCAN_MAX_ENTRIES = 20_000
"""...or after this many directory entries: a million-file dataset on Lustre would take minutes."""
ALLOCATION_BYTES = 4096  # files occupy whole filesystem blocks


class NodeUnhealthy(RunFailure):
    """A node failed its preflight. `node` is the Slurm node name, `checks` the failed checks."""

    def __init__(self, node: str, checks: list[Check], report_path: Path | None = None,
                 run_dir: Path | None = None) -> None:
        self.node, self.checks, self.report_path = node, checks, report_path
        problems = "; ".join(f"{c.name}: {c.reason}" for c in checks)
        where = f" (details: {report_path})" if report_path else ""
        super().__init__(f"node {node} failed the preflight: {problems}. " + resume_hint(node, run_dir) + where)


def resume_hint(node: str, run_dir: Path | None) -> str:
    """The exact command that goes on without the node (the run's newest checkpoint; a run that never saved one is
    submitted again with site.exclude), and the site-wide way."""
    import shlex

    if run_dir is None:
        return f"Resubmit without it: site.exclude=[{node}], or add it to the site profile's site.exclude"
    return (f"Go on without it: embodyhpc resume {shlex.quote(str(run_dir))} --exclude {shlex.quote(node)} "
            f"(a run without a checkpoint yet: submit again with site.exclude=[{node}]; a node bad for every run: "
            "add it to the site profile's site.exclude)")


@dataclass
class PreflightResult:
    node: str
    checks: list[Check]
    elapsed_s: float = 0.0
    gpu_count: int = 0
    report_path: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        return worst(self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status is Status.FAIL]

    def to_dict(self) -> dict[str, Any]:
        """Keys "hostname", "status", "checks" follow the doctor JSON, so `nodes_to_exclude` reads these files."""
        return {"hostname": self.node, "status": self.status.value, "exclude": self.node if self.failed else None,
                "checks": [c.to_dict() for c in self.checks], "gpu_count": self.gpu_count,
                "elapsed_s": round(self.elapsed_s, 4), **self.extra}


def preflight(resources: ResourcesConfig, network: NetworkConfig, staging: StagingConfig, data: DataConfig, *,
              node: str, checkpoint_dir: str | os.PathLike | None = None, logs_dir: str | os.PathLike | None = None,
              gpu_backend: GpuBackend | None = None, sysfs_root: str | os.PathLike = DEFAULT_SYSFS_ROOT,
              dataset_bytes: int | None = None, raise_on_failure: bool = True,
              run_dir: str | os.PathLike | None = None) -> PreflightResult:
    """Check this node for the job; write `<logs_dir>/preflight-<node>.json` when `logs_dir` is given.

    `dataset_bytes` overrides the scans of the datasets (data.root or data.datasets) when staging is on.
    `gpu_backend` defaults to NVML (NoGpuBackend without a driver). Raises NodeUnhealthy when a check failed, unless
    `raise_on_failure` is False; warnings never fail a node.
    """
    start = time.perf_counter()
    result = PreflightResult(node=node, checks=[])
    result.checks += _check_gpus(resources.gpus_per_node, gpu_backend, result)
    result.checks += _check_rdma(network, str(sysfs_root))
    if staging.enabled:
        result.checks += _check_staging(staging, data, dataset_bytes, result.extra)
    if checkpoint_dir is not None:
        result.checks.append(check_writable(Path(checkpoint_dir)))
    result.elapsed_s = time.perf_counter() - start
    result.extra.update(job_id=os.environ.get("SLURM_JOB_ID"),
                        restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0), time=time.time())
    if logs_dir is not None:
        result.report_path = write_result(result, Path(logs_dir))
    if result.failed and raise_on_failure:
        raise NodeUnhealthy(node, result.failed, result.report_path, Path(run_dir) if run_dir is not None else None)
    return result


def run_preflight_for_job(run_dir: str | os.PathLike, config: Config, local_rank: int,
                          node: str) -> PreflightResult | None:
    """The launch hook: local rank 0 of each node checks it (the others return None at once), against the
    run's checkpoint folder and logs/. Skipped when `resources.preflight` is false. Runs no collectives."""
    from embodyhpc.rundir import CHECKPOINTS_DIR, LOGS_DIR

    if local_rank != 0 or not config.resources.preflight:
        return None
    run_path = Path(run_dir)
    return preflight(config.resources, config.network, config.staging, config.data, node=node,
                     checkpoint_dir=run_path / CHECKPOINTS_DIR, logs_dir=run_path / LOGS_DIR, run_dir=run_path)


def write_result(result: PreflightResult, logs_dir: Path) -> Path:
    from embodyhpc.atomic import write_json_atomic

    logs_dir.mkdir(parents=True, exist_ok=True)
    path = logs_dir / f"preflight-{result.node}.json"
    write_json_atomic(path, result.to_dict())
    return path


def _check_gpus(expected: int, backend: GpuBackend | None, result: PreflightResult) -> list[Check]:
    gpus_backend = backend or open_gpu_backend()
    try:
        gpus = gpus_backend.health()
        result.gpu_count = len(gpus)
        if not expected:  # a CPU job does not care about the GPUs' health
            seen = f"{len(gpus)} visible, not checked" if gpus else "none visible"
            return [ok("gpus", f"no GPU requested (resources.gpus_per_node=0); {seen}")]
        checks = check_gpus(gpus_backend, gpus, expected)
    except Exception as exc:  # a broken driver is a verdict on the node, not a crash
        return [fail("gpus", f"NVML query failed: {exc}")]
    finally:
        if backend is None:
            gpus_backend.close()
    # the doctor only warns at the retirement limit; a job of days on such a board risks the next
    # double-bit error, and excluding one node is cheaper than losing the run
    return [fail(c.name, c.reason) if c.name.endswith(".pages") else c for c in checks]


def _check_rdma(network: NetworkConfig, root: str) -> list[Check]:
    ports = read_ib_ports(root)
    return check_ib(ports, hcas=network.hcas or None, fabric=network.fabric, gid_index=network.gid_index,
                    ib_disabled=network.fabric == "ethernet", from_profile=True, root=root)


def _check_staging(staging: StagingConfig, data: DataConfig, dataset_bytes: int | None,
                   extra: dict[str, Any]) -> list[Check]:
    nvme = Path(staging.nvme_dir)
    existing = nvme
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent  # staging creates the folder; its filesystem is what must have room
    try:
        usage = shutil.disk_usage(existing)
    except OSError as exc:
        return [fail("nvme", f"staging.nvme_dir {nvme}: {exc}")]
    if not os.access(existing, os.W_OK):
        return [fail("nvme", f"staging.nvme_dir {nvme}: {existing} is not writable on this node")]
    required = _bytes_to_stage(nvme, data, dataset_bytes, extra)
    info = NvmeInfo(path=str(nvme), exists=True, free_bytes=usage.free, total_bytes=usage.total)
    checks = check_nvme(info, required, min_write_mb_s=0.0)
    if required is None and all(c.status is Status.OK for c in checks):
        checks = [ok(c.name, f"{c.reason}; dataset size unknown ({extra.get('dataset_scan')}), not compared")
                  for c in checks]
    return checks


def _bytes_to_stage(nvme: Path, data: DataConfig, dataset_bytes: int | None, extra: dict[str, Any]) -> int | None:
    """Bytes staging still has to write (every dataset it stages, data.root or each root of data.datasets, minus what
    an earlier run already staged of it), plus the margin `stage()` keeps free; None when a size is not known
    cheaply (the scans share one budget). `dataset_bytes` stands for the scans: the size of them all."""
    from embodyhpc.staging import load_manifest, node_local_path
    from embodyhpc.staging.stage import SPACE_MARGIN_BYTES, SPACE_MARGIN_FRACTION

    roots = [] if data.format == "synthetic" else [e.root for e in data.datasets] if data.datasets else \
        [data.root] if data.root else []
    sizes: list[int] = []  # each root's scanned size (none when `dataset_bytes` stands for the scans)
    if dataset_bytes is None:
        if not roots:
            extra["dataset_scan"] = "synthetic data"
            return None
        scans, deadline = [], time.perf_counter() + SCAN_BUDGET_S
        for root in roots:
            size, why = scan_size(Path(root), budget_s=max(0.0, deadline - time.perf_counter()))
            scans.append(why)
            if size is None:
                extra["dataset_scan"] = why
                return None
            sizes.append(size)
        extra["dataset_scan"] = "; ".join(scans)
        dataset_bytes = sum(sizes)
    staged = [_staged_bytes(load_manifest, node_local_path(nvme, root)) for root in roots]
    if sizes:
        to_copy = sum(max(0, size - done) for size, done in zip(sizes, staged, strict=True))  # each dataset's rest
    else:
        to_copy = max(0, dataset_bytes - sum(staged))
    allocated = -(-to_copy // ALLOCATION_BYTES) * ALLOCATION_BYTES
    extra.update(dataset_bytes=dataset_bytes, staged_bytes=sum(staged))
    return 0 if not to_copy else allocated + SPACE_MARGIN_BYTES + int(SPACE_MARGIN_FRACTION * allocated)


def _staged_bytes(load_manifest: Any, dest: Path) -> int:
    """What an earlier run already staged at `dest` (its manifest's files); 0 when there is no readable manifest."""
    try:
        manifest = load_manifest(dest)
    except Exception:  # an unreadable manifest means staging copies everything again
        return 0
    return sum(e.size for e in manifest.files.values()) if manifest else 0


def scan_size(root: Path, *, budget_s: float = SCAN_BUDGET_S,
              max_entries: int = SCAN_MAX_ENTRIES) -> tuple[int | None, str]:
    """(total bytes of the files under `root`, how the scan went); (None, why) when it ran out of budget."""
    deadline = time.perf_counter() + budget_s
    total, entries, stack = 0, 0, [root]
    try:
        while stack:
            with os.scandir(stack.pop()) as listing:
                for entry in listing:
                    entries += 1
                    if entries > max_entries or time.perf_counter() > deadline:
                        return None, f"scan of {root} stopped after {entries - 1} entries"
                    if entry.is_dir():
                        stack.append(Path(entry.path))
                    elif entry.is_file():
                        total += entry.stat().st_size
    except OSError as exc:
        return None, f"scan of {root} failed: {exc.strerror or exc}"
    return total, f"{entries} entries, {human_bytes(total)}"


def check_writable(directory: Path) -> Check:
    """Create the folder if needed, write and delete a small file (no fsync: this is a permission/mount probe)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".preflight-") as handle:
            handle.write(b"embodyhpc preflight\n")
            handle.flush()
    except OSError as exc:
        return fail("checkpoint_dir", f"cannot write to the checkpoint folder {directory} from this node: "
                                      f"{exc.strerror or exc}")
    return ok("checkpoint_dir", f"checkpoint folder {directory} is writable")


__all__ = ["NodeUnhealthy", "PreflightResult", "check_writable", "preflight", "run_preflight_for_job", "scan_size"]
