"""`embodyhpc smoke --submit` on the real 2-node cluster: one job on one node, through the site profile, that runs
the smoke table of the recipe's model there and leaves smoke.json in its run directory; status and logs know the
job."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import statuses, wait_for
from tests.train.test_smoke import check_cpu_report

pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("slurm"), pytest.mark.slow]


@pytest.mark.parametrize(("recipe", "model", "policy"), [("recipes/smoke_cpu.yaml", "pi05", "Pi05Policy")])
def test_smoke_submit_runs_on_one_node_and_writes_the_table(cli, slurm_cluster, runs_root, recipe, model,
                                                            policy) -> None:
    """pi0.5's table here, GR00T's through the CLI on this machine (tests/train/test_smoke.py), checked alike: each
    model's rows run once per test run. Which model the job smokes (the request's, else the recipe's) is
    tests/train/test_smoke.py's `test_the_smoke_job_smokes_the_model_its_request_names_else_its_recipes`."""
    result = cli("smoke", recipe, "--site", "local", "--submit", "--steps", "4", f"job.runs_root={runs_root}")
    assert result.code == 0, result.err
    run_dir = Path(re.search(r"run directory: (\S+)", result.out).group(1))
    assert json.loads((run_dir / "smoke-request.json").read_text()) == {"model": model, "steps": 4, "size": "tiny"}
    assert run_dir.name.startswith("smoke-") and (run_dir / "scripts" / "smoke.sbatch").is_file()
    script = (run_dir / "scripts" / "smoke.sbatch").read_text()
    assert "#SBATCH --nodes=1" in script and "#SBATCH --ntasks-per-node=1" in script
    done = wait_for(lambda: (s := statuses(cli, run_dir).get("smoke")) and s["state"] in
                    ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and s, 600, "the smoke job to end", poll_s=3)
    assert done["state"] == "COMPLETED", done
    table = json.loads((run_dir / "smoke.json").read_text())
    check_cpu_report(table, model, "tiny", policy)
    passed = [row for row in table["rows"] if row["status"] == "passed"]
    assert len(passed) == 5 and all(row["path"]["device"] == "cpu" and row["model"] == policy for row in passed)
    logs = cli("logs", str(run_dir), "--job", "smoke")
    assert logs.code == 0 and "5 ran, 5 passed, 0 failed" in logs.out
    assert f"embodyhpc smoke of {model} tiny on CPU only" in logs.out
