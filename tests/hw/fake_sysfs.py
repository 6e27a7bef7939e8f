"""Fake /sys/class/infiniband trees, written file by file as the kernel shows them.

Each attribute holds the text the kernel's show() function prints, newline included:
state "4: ACTIVE\\n", phys_state "5: LinkUp\\n", rate "400 Gb/sec (4X NDR)\\n", GIDs in the
full 8-group form of "%pI6". The GID table has one file per slot; empty slots read as the zero GID
and have no readable type or netdev (the kernel answers EINVAL; here the file is absent).
"""

from __future__ import annotations

from pathlib import Path

ZERO_GID = ":".join(["0000"] * 8)
V1, V2 = "IB/RoCE v1", "RoCE v2"


def ipv4_mapped(address: str) -> str:
    a, b, c, d = (int(x) for x in address.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a << 8 | b:04x}:{c << 8 | d:04x}"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_port(root: Path, device: str, port: int = 1, *, state: str = "4: ACTIVE", phys_state: str = "5: LinkUp",
               rate: str = "400 Gb/sec (4X NDR)", link_layer: str = "InfiniBand",
               gids: dict[int, tuple[str, str | None, str | None]] | None = None, gid_table_len: int = 16) -> Path:
    """One port; `gids` maps slot -> (gid text, type, netdev). Device-level files are written once."""
    device_dir = root / device
    if not (device_dir / "node_type").exists():
        _write(device_dir / "node_type", "1: CA")
        _write(device_dir / "hca_type", "MT4129")
        _write(device_dir / "fw_ver", "28.39.1002")
        _write(device_dir / "board_id", "MT_0000000838")
    port_dir = device_dir / "ports" / str(port)
    for name, text in {"state": state, "phys_state": phys_state, "rate": rate, "link_layer": link_layer,
                       "lid": "0x2a" if link_layer == "InfiniBand" else "0x0", "sm_lid": "0x1", "lid_mask_count": "0",
                       "cap_mask": "0xa751e848", "pkeys/0": "0xffff", "counters/symbol_error": "0"}.items():
        _write(port_dir / name, text)
    gids = gids or {}
    for slot in range(gid_table_len):
        gid, kind, netdev = gids.get(slot, (ZERO_GID, None, None))
        _write(port_dir / "gids" / str(slot), gid)
        if kind is not None:
            _write(port_dir / "gid_attrs" / "types" / str(slot), kind)
        if netdev is not None:
            _write(port_dir / "gid_attrs" / "ndevs" / str(slot), netdev)
    return port_dir


def ib_gid(device_number: int) -> str:
    return f"fe80:0000:0000:0000:a088:c203:0045:{0x7e10 + device_number:04x}"


def ndr_ib_node(root: Path, *, down: dict[str, tuple[str, str]] | None = None,
                rates: dict[str, str] | None = None) -> Path:
    """4 single-port ConnectX-7 NDR rails mlx5_0..mlx5_3 (a DGX H100-like compute fabric)."""
    down, rates = down or {}, rates or {}
    for n in range(4):
        device = f"mlx5_{n}"
        state, phys = down.get(device, ("4: ACTIVE", "5: LinkUp"))
        write_port(root, device, state=state, phys_state=phys, rate=rates.get(device, "400 Gb/sec (4X NDR)"),
                   gids={0: (ib_gid(n), V1, None)})
    return root


def port_down_node(root: Path) -> Path:
    """The 4-rail node with mlx5_2's cable pulled: the port polls for a peer and stays DOWN."""
    return ndr_ib_node(root, down={"mlx5_2": ("1: DOWN", "2: Polling")}, rates={"mlx5_2": "10 Gb/sec (4X SDR)"})


def roce_gid_table(address: str, netdev: str, mac_suffix: str = "0e42:a1ff:fe2b:3c4d",
                   v2_index: int = 3) -> dict[int, tuple[str, str | None, str | None]]:
    """The usual mlx5 RoCE table: link-local v1/v2 at 0/1, the IPv4-mapped address as v1 at 2 and v2 at 3."""
    link_local = f"fe80:0000:0000:0000:{mac_suffix}"
    mapped = ipv4_mapped(address)
    table = {0: (link_local, V1, netdev), 1: (link_local, V2, netdev), 2: (mapped, V1, netdev)}
    table[v2_index] = (mapped, V2, netdev)
    return table


def roce_v2_node(root: Path, num_rails: int = 2) -> Path:
    """ConnectX-6 Dx 200GbE RoCE v2 rails, each with an IPv4 address on its own netdev, 255-slot GID tables."""
    for n in range(num_rails):
        write_port(root, f"mlx5_{n}", rate="200 Gb/sec (4X HDR)", link_layer="Ethernet",
                   gids=roce_gid_table(f"10.{10 + n}.0.17", f"ens{n + 1}f0np0"), gid_table_len=255)
    return root
