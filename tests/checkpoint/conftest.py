"""The checkpoint written once on 2 ranks (FSDP2 tiny pi0.5 + AdamW) that the reshard and export tests read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.checkpoint import jobs
from tests.checkpoint.distributed import run_ranks


@pytest.fixture(scope="session")
def saved_on_two_ranks(tmp_path_factory) -> Path:
    """Folder with checkpoints/step-{2,3} (2 async, 3 sync), export/, expected.pt (full states) and save_job.json."""
    out = tmp_path_factory.mktemp("saved_on_two_ranks")
    run_ranks(jobs.save_job, 2, str(out))
    return out


@pytest.fixture(scope="session")
def save_job_report(saved_on_two_ranks) -> dict:
    return json.loads((saved_on_two_ranks / "save_job.json").read_text())
