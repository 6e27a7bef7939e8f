"""The job `embodyhpc smoke --submit` runs on one node: the smoke table for that node (embodyhpc.train.smoke) of the
model and size smoke-request.json names, written to <run>/smoke.json and printed to the job's log; the job fails
when a row that ran failed."""

from __future__ import annotations

import json
from pathlib import Path

from embodyhpc.atomic import write_json_atomic
from embodyhpc.rundir import SMOKE_FILE, SMOKE_REQUEST_FILE
from embodyhpc.validation import load_resolved


class SmokeFailed(RuntimeError):
    """A path that ran on this node failed (the table in the log says which and why)."""


def smoke_task(run_dir: str) -> dict:
    from embodyhpc.train.smoke import format_report, run_smoke

    folder = Path(run_dir)
    request = json.loads((folder / SMOKE_REQUEST_FILE).read_text()) if (folder / SMOKE_REQUEST_FILE).is_file() else {}
    config = load_resolved(run_dir)
    report = run_smoke(config, model=str(request.get("model", config.model.name)),
                       steps=int(request.get("steps", 20)), size=str(request.get("size", "tiny")),
                       progress=lambda row: print(f"{row.path.name}: {row.status} {row.reason or ''}", flush=True))
    write_json_atomic(folder / SMOKE_FILE, report.as_dict())
    print(format_report(report), flush=True)
    if not report.ok:
        failed = [row.path.name for row in report.rows if row.status == "failed"]
        raise SmokeFailed(f"smoke failed on {report.device}: {', '.join(failed) or 'no path ran'}")
    return {"ok": True, "device": report.device, "model": report.model, "size": report.size}
