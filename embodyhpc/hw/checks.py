"""One verdict per preflight check: ok, warn or fail, with a one-line reason a person can act on.

Every probe in this package turns what it found into `Check` values; the doctor report only
collects and prints them, so each rule lives next to the code that reads the hardware it judges.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Status(str, Enum):
    """Severity, ordered: a node's verdict is its worst check."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Status.OK: 0, Status.WARN: 1, Status.FAIL: 2}


@dataclass(frozen=True)
class Check:
    """A verdict. `name` is stable and machine-readable ("gpu3.ecc", "ib.mlx5_2:1"); `reason` is for people."""

    name: str
    status: Status
    reason: str

    def __post_init__(self) -> None:
        # one line, always: reasons end up in Slurm logs and in `--json` output parsed per line
        object.__setattr__(self, "reason", " ".join(self.reason.split()))

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "status": self.status.value, "reason": self.reason}


def ok(name: str, reason: str) -> Check:
    return Check(name, Status.OK, reason)


def warn(name: str, reason: str) -> Check:
    return Check(name, Status.WARN, reason)


def fail(name: str, reason: str) -> Check:
    return Check(name, Status.FAIL, reason)


def worst(checks: list[Check]) -> Status:
    """The node's verdict: FAIL if any check failed, else WARN if any warned, else OK (also for no checks)."""
    return max((c.status for c in checks), key=lambda s: s.rank, default=Status.OK)


def human_bytes(num_bytes: int | float) -> str:
    """Decimal units (GB, not GiB), as `df -H` and storage vendors print them."""
    value = float(num_bytes)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(value) < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
