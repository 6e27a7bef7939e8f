"""Where checkpoints and staged data live: the runs-root filesystem and the node-local NVMe.

The runs root must be shared by all nodes of a multi-node job (DCP writes one shard per rank and
resume reads them all), so its filesystem type matters more than its speed. The NVMe path is where
datasets are staged; a full or slow disk there fails or stalls every rank of the node.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from embodyhpc.hw.checks import Check, fail, human_bytes, ok, warn
from embodyhpc.mounts import Mount, mount_for

SHARED_KINDS = frozenset({"lustre", "gpfs", "nfs", "beegfs", "weka"})
# local but gone at reboot or with the container: fine for scratch, wrong for checkpoints
EPHEMERAL_TYPES = frozenset({"tmpfs", "overlay"})


@dataclass(frozen=True)
class NvmeInfo:
    path: str
    exists: bool
    free_bytes: int | None = None
    total_bytes: int | None = None
    write_mb_s: float | None = None
    fstype: str | None = None
    kind: str | None = None
    error: str | None = None


def check_runs_root(path: str | Path, mounts: list[Mount], num_nodes: int = 1) -> tuple[Mount | None, Check]:
    mount = mount_for(path, mounts)
    if mount is None:
        return None, warn("runs_fs", f"runs root {path}: no mount found in the mount table")
    where = f"runs root {path} is on {mount.fstype} ({mount.mount_point})"
    if mount.kind in SHARED_KINDS:
        note = ": many nodes writing checkpoints at once may be slow" if mount.kind == "nfs" and num_nodes > 1 else ""
        return mount, (warn if note else ok)("runs_fs", where + note)
    if num_nodes > 1:
        # on one node only, this is usually a parallel filesystem that failed to mount there
        return mount, fail("runs_fs", f"{where}, not shared: a {num_nodes}-node job cannot resume its checkpoints "
                                      "(is the parallel filesystem mounted on this node? if it is, point the site "
                                      "profile's runs root at it)")
    if mount.fstype in EPHEMERAL_TYPES:
        return mount, warn("runs_fs", f"{where}: lost when the node or container goes away")
    return mount, ok("runs_fs", where)


def probe_write_mb_s(directory: str | Path, size_bytes: int, chunk_bytes: int = 4 << 20) -> float:
    """Write `size_bytes` to a temporary file, fsync, delete; MB/s (decimal) including the fsync,
    so the page cache does not flatter the disk. Random data, so compressing filesystems do not either."""
    chunk = os.urandom(min(chunk_bytes, size_bytes) or 1)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".embodyhpc-probe-") as handle:
        start = time.perf_counter()
        written = 0
        while written < size_bytes:
            written += handle.write(chunk[: size_bytes - written])
        handle.flush()
        os.fsync(handle.fileno())
        elapsed = max(time.perf_counter() - start, 1e-9)
    return written / 1e6 / elapsed


def probe_nvme(path: str | Path, mounts: list[Mount], probe_bytes: int) -> NvmeInfo:
    path = Path(path)
    if not path.is_dir():
        return NvmeInfo(str(path), exists=False)
    mount = mount_for(path, mounts)
    usage = shutil.disk_usage(path)
    info = {"path": str(path), "exists": True, "free_bytes": usage.free, "total_bytes": usage.total,
            "fstype": mount.fstype if mount else None, "kind": mount.kind if mount else None}
    if probe_bytes <= 0:
        return NvmeInfo(**info)
    try:
        return NvmeInfo(**info, write_mb_s=probe_write_mb_s(path, probe_bytes))
    except OSError as exc:
        return NvmeInfo(**info, error=f"write probe failed: {exc}")


def check_nvme(info: NvmeInfo, required_bytes: int | None = None, min_write_mb_s: float = 200.0) -> list[Check]:
    if not info.exists:
        return [fail("nvme", f"NVMe path {info.path} does not exist on this node")]
    checks = []
    free = info.free_bytes or 0
    if required_bytes is not None and free < required_bytes:
        checks.append(fail("nvme", f"NVMe {info.path} has {human_bytes(free)} free, staging needs "
                                   f"{human_bytes(required_bytes)}"))
    if info.error:
        checks.append(fail("nvme", f"NVMe {info.path}: {info.error}"))
    if info.kind in SHARED_KINDS:
        checks.append(warn("nvme", f"NVMe path {info.path} is on {info.fstype}, not a node-local disk"))
    if info.write_mb_s is not None and info.write_mb_s < min_write_mb_s:
        checks.append(warn("nvme", f"NVMe {info.path} writes at {info.write_mb_s:.0f} MB/s "
                                   f"(expected at least {min_write_mb_s:.0f})"))
    if not checks:
        speed = f", writes at {info.write_mb_s:.0f} MB/s" if info.write_mb_s is not None else ""
        checks.append(ok("nvme", f"NVMe {info.path}: {human_bytes(free)} free of "
                                 f"{human_bytes(info.total_bytes or 0)}{speed}"))
    return checks
