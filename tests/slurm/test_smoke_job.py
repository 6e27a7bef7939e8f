"""`embodyhpc smoke --submit` on the real 2-node cluster: one job on one node, through the site profile, that runs
the smoke table there and leaves smoke.json in its run directory; status and logs know the job."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import statuses, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_smoke_submit_runs_on_one_node_and_writes_the_table(cli, slurm_cluster, runs_root) -> None:
    result = cli("smoke", "recipes/smoke_cpu.yaml", "--site", "local", "--submit", "--steps", "4",
                 f"job.runs_root={runs_root}")
    assert result.code == 0, result.err
    run_dir = Path(re.search(r"run directory: (\S+)", result.out).group(1))
    assert run_dir.name.startswith("smoke-") and (run_dir / "scripts" / "smoke.sbatch").is_file()
    script = (run_dir / "scripts" / "smoke.sbatch").read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --ntasks-per-node=1" in script
    done = wait_for(lambda: (s := statuses(cli, run_dir).get("smoke")) and s["state"] in
                    ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s, 600, "the smoke job to end", poll_s=3)
    assert done["state"] == "COMPLETED", done
    table = json.loads((run_dir / "smoke.json").read_text())
    assert table["ok"] and table["device"] == "CPU only"
    passed = [row for row in table["rows"] if row["status"] == "passed"]
    assert len(passed) == 5 and all(row["path"]["device"] == "cpu" for row in passed)
    logs = cli("logs", str(run_dir), "--job", "smoke")
    assert logs.code == 0 and "5 ran, 5 passed, 0 failed" in logs.out
