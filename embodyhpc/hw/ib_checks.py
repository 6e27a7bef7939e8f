"""Judging RDMA ports against what the job will ask NCCL to use.

The rails a job uses come from the network profile (`network.hcas`) or, inside a job, from the
NCCL_IB_HCA it exported. A listed rail that is not ACTIVE fails the node: NCCL would either run
on fewer rails (silently slower for everyone) or hang. Without a list, every port counts but a
down port only warns, because spare or unplugged ports are common; list the rails to make it strict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from embodyhpc.hw.checks import Check, fail, ok, warn
from embodyhpc.hw.ib import ROCE_V2, IbPort

_LINK_LAYER_OF_FABRIC = {"ib": "InfiniBand", "roce": "Ethernet"}
_SOURCES = {True: ("network.hcas", "network.gid_index"), False: ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX")}
_STATE_HINTS = {
    "INIT": "link is up but no subnet manager has configured it",
    "ARMED": "waiting for the subnet manager",
    "Polling": "no cable or no peer",
    "Disabled": "the port is administratively disabled",
}


@dataclass(frozen=True)
class HcaSpec:
    """NCCL_IB_HCA parsed: "^" excludes the listed devices, "=" asks for exact device names (else prefixes)."""

    entries: tuple[tuple[str, int | None], ...]
    exclude: bool = False
    exact: bool = False

    @classmethod
    def parse(cls, text: str | Sequence[str] | None) -> HcaSpec | None:
        if text is None:
            return None
        raw = text if isinstance(text, str) else ",".join(text)
        raw = raw.strip()
        exclude = raw.startswith("^")
        raw = raw.removeprefix("^")
        exact = raw.startswith("=")
        raw = raw.removeprefix("=")
        entries = []
        for item in filter(None, (part.strip() for part in raw.split(","))):
            device, _, port = item.partition(":")
            entries.append((device, int(port) if port.isdigit() else None))
        return cls(tuple(entries), exclude, exact) if entries else None

    def matches(self, port: IbPort, entry: tuple[str, int | None]) -> bool:
        device, number = entry
        device_ok = port.device == device if self.exact else port.device.startswith(device)
        return device_ok and (number is None or number == port.port)

    def select(self, ports: Sequence[IbPort]) -> tuple[list[IbPort], list[str]]:
        """(ports the job uses, entries that match no port on this node)."""
        hit = [p for p in ports if any(self.matches(p, e) for e in self.entries)]
        unmatched = [f"{d}:{n}" if n is not None else d for d, n in self.entries
                     if not any(self.matches(p, (d, n)) for p in ports)]
        if self.exclude:
            return [p for p in ports if p not in hit], []
        return hit, unmatched


def check_ib(ports: Sequence[IbPort], *, hcas: str | Sequence[str] | None = None, fabric: str | None = None,
             gid_index: int | None = None, ib_disabled: bool = False, from_profile: bool = False,
             root: str = "/sys/class/infiniband") -> list[Check]:
    """Checks for the ports under `root`. `from_profile` says whether `hcas`/`gid_index` came from the network
    profile or from exported NCCL variables, so that reasons name the setting to fix."""
    source, gid_source = _SOURCES[from_profile]
    spec = HcaSpec.parse(hcas)
    explicit = spec is not None and not spec.exclude
    wants_rdma = fabric in _LINK_LAYER_OF_FABRIC or explicit
    if not ports:
        if wants_rdma:
            hca_text = hcas if isinstance(hcas, str) else ",".join(hcas or ())
            wanted = f"{source}={hca_text}" if explicit else f"fabric {fabric}"
            return [fail("ib", f"no RDMA devices under {root}, but the job expects {wanted}")]
        return [ok("ib", f"no InfiniBand/RoCE devices under {root}: NCCL will use TCP sockets")]
    used, unmatched = spec.select(ports) if spec else (list(ports), [])
    checks = [fail("ib", f"{source} entry {entry} matches no RDMA port on this node") for entry in unmatched]
    bad = fail if explicit else warn
    for port in used:
        if not port.active:
            hint = _STATE_HINTS.get(port.state) or _STATE_HINTS.get(port.phys_state, "")
            checks.append(bad(f"ib.{port.name}", f"{port.device} port {port.port} is {port.state} "
                                                 f"(phys {port.phys_state}{': ' + hint if hint else ''})"))
    active = [p for p in used if p.active]
    want_layer = _LINK_LAYER_OF_FABRIC.get(fabric or "")
    if want_layer and explicit:
        checks += [fail(f"ib.{p.name}", f"{p.name} has link layer {p.link_layer}, fabric {fabric} needs {want_layer}")
                   for p in active if p.link_layer != want_layer]
    checks += _slow_rails(active)
    if gid_index is not None and gid_index >= 0:  # -1 (or unset): NCCL picks the RoCE v2 GID itself
        checks += _gid_problems([p for p in active if p.link_layer == "Ethernet"], gid_index, gid_source)
    if ib_disabled and active:
        checks.append(warn("ib", f"NCCL_IB_DISABLE=1 but {len(active)} RDMA ports are ACTIVE: NCCL will use TCP "
                                 "(see `embodyhpc doctor --suggest-network`)"))
    if active:
        layers = ", ".join(sorted({f"{p.link_layer} {p.rate}" for p in active}))
        checks.insert(0, ok("ib", f"{len(active)}/{len(used)} ports ACTIVE ({layers}): "
                                  f"{', '.join(p.name for p in active)}"))
    elif not any(c.name == "ib" for c in checks):
        checks.insert(0, bad("ib", f"none of {len(used)} RDMA ports is ACTIVE"))
    return checks


def _slow_rails(active: list[IbPort]) -> list[Check]:
    # a rail that trained at a lower rate (bad cable, dirty optics) slows every ring that crosses it
    checks = []
    for layer in sorted({p.link_layer for p in active}):
        same = [p for p in active if p.link_layer == layer and p.rate_gbps is not None]
        fastest = max((p.rate_gbps or 0.0 for p in same), default=0.0)
        checks += [warn(f"ib.{p.name}", f"{p.name} runs at {p.rate}, other {layer} rails at {fastest:g} Gb/sec: "
                                        "a degraded link slows every collective")
                   for p in same if (p.rate_gbps or 0.0) < fastest]
    return checks


def _gid_problems(ports: list[IbPort], gid_index: int, source: str) -> list[Check]:
    checks = []
    for port in ports:
        entry = port.gid(gid_index)
        if entry is None:
            checks.append(fail(f"ib.{port.name}", f"{port.name} has no GID at index {gid_index} ({source})"))
        elif entry.type != ROCE_V2:
            checks.append(fail(f"ib.{port.name}", f"{port.name} GID index {gid_index} is {entry.type or 'untyped'}, "
                                                  f"not {ROCE_V2} ({source})"))
    return checks
