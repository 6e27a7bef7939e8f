"""InfiniBand / RoCE ports as the kernel exposes them under /sys/class/infiniband.

Layout read here (kernel ABI, Documentation/ABI/stable/sysfs-class-infiniband), per device and port:
  <dev>/ports/<N>/state           "4: ACTIVE"
  <dev>/ports/<N>/phys_state      "5: LinkUp"
  <dev>/ports/<N>/rate            "400 Gb/sec (4X NDR)"
  <dev>/ports/<N>/link_layer      "InfiniBand" or "Ethernet" (RoCE)
  <dev>/ports/<N>/gids/<I>        "fe80:0000:0000:0000:0e42:a1ff:fe2b:3c4d" (empty entries read as zeros)
  <dev>/ports/<N>/gid_attrs/types/<I>   "IB/RoCE v1" or "RoCE v2" (reading an empty entry fails)
  <dev>/ports/<N>/gid_attrs/ndevs/<I>   the netdev of a RoCE GID (reading fails on IB ports)
Reading sysfs is cheap and needs no rdma-core tools, which compute nodes in containers often lack.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SYSFS_ROOT = Path("/sys/class/infiniband")
ZERO_GID = ":".join(["0000"] * 8)
ROCE_V2 = "RoCE v2"


@dataclass(frozen=True)
class GidEntry:
    """One populated GID table entry. `type` and `ndev` are None where the kernel refuses to say."""

    index: int
    gid: str
    type: str | None = None
    ndev: str | None = None

    @property
    def ipv4(self) -> str | None:
        """The dotted IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), else None."""
        groups = self.gid.split(":")
        if len(groups) != 8 or any(int(g, 16) for g in groups[:5]) or int(groups[5], 16) != 0xFFFF:
            return None
        value = (int(groups[6], 16) << 16) | int(groups[7], 16)
        return ".".join(str((value >> shift) & 0xFF) for shift in (24, 16, 8, 0))

    @property
    def link_local(self) -> bool:
        return self.gid.lower().startswith("fe80:")


@dataclass(frozen=True)
class IbPort:
    device: str
    port: int
    state: str
    """Port state name: ACTIVE, DOWN, INIT (link up, no subnet manager), ARMED, ..."""
    phys_state: str
    """Physical state name: LinkUp, Polling (no cable/peer), Disabled, ..."""
    rate: str
    """As the kernel prints it, e.g. "400 Gb/sec (4X NDR)"."""
    link_layer: str
    """InfiniBand, or Ethernet for RoCE."""
    gids: tuple[GidEntry, ...] = ()

    @property
    def name(self) -> str:
        """The NCCL_IB_HCA spelling: mlx5_0:1."""
        return f"{self.device}:{self.port}"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def rate_gbps(self) -> float | None:
        match = re.match(r"\s*([\d.]+)\s*Gb/sec", self.rate)
        return float(match.group(1)) if match else None

    def gid(self, index: int) -> GidEntry | None:
        return next((g for g in self.gids if g.index == index), None)


def _read(path: Path) -> str | None:
    """A sysfs attribute without its newline; None when absent or when the kernel refuses (EINVAL, EIO)."""
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _state_name(raw: str | None) -> str:
    # "4: ACTIVE" -> "ACTIVE"; "7: Phy Test" -> "Phy Test"
    if raw is None:
        return "UNKNOWN"
    return raw.split(":", 1)[1].strip() if ":" in raw else raw


def _natural_key(text: str) -> list[object]:
    # mlx5_10 sorts after mlx5_9, as people (and NCCL's device order) expect
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _read_gids(port_dir: Path) -> tuple[GidEntry, ...]:
    gids_dir = port_dir / "gids"
    if not gids_dir.is_dir():
        return ()
    entries = []
    for path in sorted(gids_dir.iterdir(), key=lambda p: _natural_key(p.name)):
        if not path.name.isdigit():
            continue
        gid = _read(path)
        if gid is None or gid == ZERO_GID:
            continue
        index = int(path.name)
        entries.append(GidEntry(index=index, gid=gid,
                                type=_read(port_dir / "gid_attrs" / "types" / path.name),
                                ndev=_read(port_dir / "gid_attrs" / "ndevs" / path.name)))
    return tuple(sorted(entries, key=lambda e: e.index))


def read_ib_ports(root: str | Path = DEFAULT_SYSFS_ROOT) -> list[IbPort]:
    """Every port of every RDMA device under `root`, in natural device/port order; [] when there is none."""
    root = Path(root)
    if not root.is_dir():
        return []
    ports = []
    for device_dir in sorted(root.iterdir(), key=lambda p: _natural_key(p.name)):
        ports_dir = device_dir / "ports"
        if not ports_dir.is_dir():
            continue
        for port_dir in sorted(ports_dir.iterdir(), key=lambda p: _natural_key(p.name)):
            if not port_dir.name.isdigit():
                continue
            ports.append(IbPort(
                device=device_dir.name,
                port=int(port_dir.name),
                state=_state_name(_read(port_dir / "state")),
                phys_state=_state_name(_read(port_dir / "phys_state")),
                rate=_read(port_dir / "rate") or "unknown",
                link_layer=_read(port_dir / "link_layer") or "Unknown",
                gids=_read_gids(port_dir),
            ))
    return ports
