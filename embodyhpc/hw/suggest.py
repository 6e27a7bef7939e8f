"""Propose the `network:` section of a site profile from the RDMA ports one node has.

Rules, in order (the result always validates as `embodyhpc.config.network.NetworkConfig(**section)`):
1. Only ACTIVE ports of devices named like `device_prefixes` (mlx5 by default: ConnectX NICs, what
   GPU clusters use for their compute rails) are candidates; others are on-board or management NICs.
2. Any candidate with link layer InfiniBand -> fabric "ib", hcas = every such port ("mlx5_0:1", ...).
   Ethernet ports on the same node (often a storage NIC) are left out.
3. Else candidates with link layer Ethernet -> fabric "roce" with one GID index for all of them
   (NCCL_IB_GID_INDEX is global). Per port the preferred entry is the lowest-index "RoCE v2" GID that
   is IPv4-mapped (::ffff:a.b.c.d): NCCL's default address family is IPv4, and those entries route
   across subnets, unlike link-local (fe80::) ones. A global IPv6 RoCE v2 entry is the fallback.
   The index most ports agree on wins; a port without a RoCE v2 entry there is left out.
4. Else fabric "ethernet" (TCP sockets).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from embodyhpc.hw.ib import ROCE_V2, IbPort

DEFAULT_DEVICE_PREFIXES = ("mlx5",)


def roce_v2_gid_index(port: IbPort) -> int | None:
    """The GID index NCCL should use on this RoCE port (rule 3 above), or None when it has no usable entry."""
    v2 = [g for g in port.gids if g.type == ROCE_V2]
    ipv4 = [g.index for g in v2 if g.ipv4 is not None]
    global_v6 = [g.index for g in v2 if g.ipv4 is None and not g.link_local]
    return min(ipv4, default=None) if ipv4 else min(global_v6, default=None)


def suggest_network_with_reasons(ports: Sequence[IbPort], device_prefixes: Sequence[str] = DEFAULT_DEVICE_PREFIXES,
                                 ) -> tuple[dict[str, Any], list[str]]:
    """The `network:` section and one line per decision, for `embodyhpc doctor --suggest-network`."""
    reasons: list[str] = []
    candidates = [p for p in ports if p.active and p.device.startswith(tuple(device_prefixes))]
    skipped = [p.name for p in ports if p not in candidates]
    if skipped:
        reasons.append(f"not used: {', '.join(skipped)} (not ACTIVE or not {'/'.join(device_prefixes)})")
    ib = [p for p in candidates if p.link_layer == "InfiniBand"]
    if ib:
        others = [p.name for p in candidates if p not in ib]
        if others:
            reasons.append(f"left out Ethernet ports {', '.join(others)}: the InfiniBand rails carry NCCL traffic")
        if len({p.rate for p in ib}) > 1:
            reasons.append(f"rails differ in rate ({', '.join(f'{p.name} {p.rate}' for p in ib)}): check cabling")
        reasons.append(f"fabric ib: {len(ib)} ACTIVE InfiniBand ports")
        return {"fabric": "ib", "hcas": [p.name for p in ib]}, reasons
    roce = {p.name: roce_v2_gid_index(p) for p in candidates if p.link_layer == "Ethernet"}
    for name in [n for n, index in roce.items() if index is None]:
        reasons.append(f"left out {name}: no routable RoCE v2 GID (only link-local or RoCE v1 entries)")
    usable = {n: i for n, i in roce.items() if i is not None}
    if not usable:
        reasons.append("fabric ethernet: no ACTIVE InfiniBand port and no RoCE port with a RoCE v2 GID")
        return {"fabric": "ethernet"}, reasons
    counts = Counter(usable.values())
    gid_index = min(counts, key=lambda i: (-counts[i], i))  # most common, then lowest
    by_name = {p.name: p for p in candidates}
    hcas = []
    for name in usable:
        entry = by_name[name].gid(gid_index)
        if entry is not None and entry.type == ROCE_V2:
            hcas.append(name)
        else:
            reasons.append(f"left out {name}: its RoCE v2 GID is at index {usable[name]}, the others use {gid_index}")
    chosen = by_name[hcas[0]].gid(gid_index)
    family = "IPv4-mapped" if chosen is not None and chosen.ipv4 else "global IPv6"
    reasons.append(f"fabric roce: {len(hcas)} ACTIVE RoCE ports, GID index {gid_index} ({family} RoCE v2 entry)")
    return {"fabric": "roce", "hcas": hcas, "gid_index": gid_index}, reasons


def suggest_network(ports: Sequence[IbPort], device_prefixes: Sequence[str] = DEFAULT_DEVICE_PREFIXES,
                    ) -> dict[str, Any]:
    """The `network:` section for these ports; see the module docstring for the rules."""
    return suggest_network_with_reasons(ports, device_prefixes)[0]
