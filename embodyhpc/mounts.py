"""The mount table: which filesystem holds a path (/proc/mounts, the longest mount point that contains it).

Below the two that ask: the doctor and preflight (embodyhpc/hw/storage.py: is the runs root shared, is the NVMe
local) and staging (embodyhpc/staging/stage.py: is a source local enough to copy small files on one thread).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

FS_KINDS = {
    "lustre": "lustre", "gpfs": "gpfs", "nfs": "nfs", "nfs4": "nfs", "beegfs": "beegfs", "wekafs": "weka",
    "ext4": "local", "ext3": "local", "xfs": "local", "btrfs": "local", "zfs": "local", "tmpfs": "local",
    "overlay": "local",
}


@dataclass(frozen=True)
class Mount:
    device: str
    mount_point: str
    fstype: str

    @property
    def kind(self) -> str:
        """lustre, gpfs, nfs, beegfs, weka, local, or "other" (fuse.*, cephfs, ...)."""
        return FS_KINDS.get(self.fstype, "other")


def _unescape(field: str) -> str:
    # the kernel writes space, tab, newline and backslash in mount points as octal escapes (\040 ...)
    for code in ("\\040", "\\011", "\\012", "\\134"):
        field = field.replace(code, chr(int(code[1:], 8)))
    return field


def read_mounts(mounts_path: str | Path = "/proc/mounts") -> list[Mount]:
    mounts = []
    for line in Path(mounts_path).read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3:
            mounts.append(Mount(_unescape(fields[0]), _unescape(fields[1]), fields[2]))
    return mounts


def mount_for(path: str | Path, mounts: list[Mount]) -> Mount | None:
    """The mount holding `path`: the longest mount point that is a whole-component prefix of it.
    On ties the later line wins, since a later mount on the same point hides the earlier one."""
    target = os.path.realpath(path)
    best: Mount | None = None
    for mount in mounts:
        point = mount.mount_point.rstrip("/") or "/"
        inside = target == point or target.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.mount_point.rstrip("/") or "/")):
            best = mount
    return best
