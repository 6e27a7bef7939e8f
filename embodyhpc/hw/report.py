"""The doctor report for people (text) and for machines (`--json`), and the cluster-wide exclude list.

The JSON form is what each node of a job writes; `nodes_to_exclude` reads those back, so its keys
("hostname", "status", "checks") are a contract: change them only together.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from embodyhpc.hw.checks import Status

if TYPE_CHECKING:
    from embodyhpc.hw.doctor import DoctorReport
    from embodyhpc.hw.ib import IbPort

_LABEL = {Status.OK: "ok", Status.WARN: "WARN", Status.FAIL: "FAIL"}


def _port_dict(port: IbPort) -> dict[str, Any]:
    data = asdict(port)
    data.update(name=port.name, active=port.active, rate_gbps=port.rate_gbps)
    data["gids"] = [{**asdict(g), "ipv4": g.ipv4} for g in port.gids]
    return data


def to_dict(report: DoctorReport) -> dict[str, Any]:
    """JSON-ready: only str/int/float/bool/None/list/dict inside."""
    return {
        "hostname": report.hostname,
        "status": report.status.value,
        "exit_code": report.exit_code(),
        "exclude": report.hostname if report.failed else None,
        "checks": [c.to_dict() for c in report.checks],
        "gpu_backend": report.gpu_backend,
        "gpu_note": report.gpu_note,
        "driver_version": report.driver_version,
        "gpus": [asdict(g) for g in report.gpus],
        "ib_ports": [_port_dict(p) for p in report.ib_ports],
        "runs_fs": None if report.runs_fs is None else {**asdict(report.runs_fs), "kind": report.runs_fs.kind},
        "nvme": None if report.nvme is None else asdict(report.nvme),
        "versions": dict(report.versions),
        "nccl_env": dict(report.nccl_env),
        "elapsed_s": round(report.elapsed_s, 3),
    }


def to_text(report: DoctorReport) -> str:
    counts = {s: sum(c.status is s for c in report.checks) for s in Status}
    lines = [f"embodyhpc doctor on node {report.hostname}: {_LABEL[report.status]} "
             f"({counts[Status.FAIL]} failed, {counts[Status.WARN]} warnings, {counts[Status.OK]} ok) "
             f"in {report.elapsed_s:.1f} s"]
    width = max((len(c.name) for c in report.checks), default=0)
    lines += [f"  {_LABEL[c.status]:<4}  {c.name:<{width}}  {c.reason}" for c in report.checks]
    if report.failed:
        lines.append(f"EXCLUDE THIS NODE: {report.hostname} (sbatch --exclude={report.hostname}); "
                     f"failed: {', '.join(c.name for c in report.failed)}")
    elif counts[Status.WARN]:
        lines.append(f"node {report.hostname} can run the job; the warnings above may cost speed")
    else:
        lines.append(f"node {report.hostname} is ready")
    return "\n".join(lines)


def nodes_to_exclude(reports: Iterable[DoctorReport | dict[str, Any]]) -> list[str]:
    """Sorted names of the nodes whose report failed, from report objects or their `to_dict()` JSON."""
    names = set()
    for item in reports:
        data = item if isinstance(item, dict) else to_dict(item)
        if data["status"] == Status.FAIL.value:
            names.add(data["hostname"])
    return sorted(names)
