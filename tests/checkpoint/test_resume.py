"""Resume is exact: a job that dies after its step-3 save and a fresh job that resumes produce the losses of one
uninterrupted run (same data order from the sampler state, same noise from the restored RNG streams)."""

from __future__ import annotations

import json

import pytest

from tests.checkpoint import jobs
from tests.checkpoint.distributed import run_ranks


@pytest.mark.slow  # two 2-rank jobs one after the other: ~2.5 s
def test_resumed_run_matches_an_uninterrupted_run_loss_for_loss(tmp_path):
    run_ranks(jobs.resume_first_job, 2, str(tmp_path))
    run_ranks(jobs.resume_second_job, 2, str(tmp_path))
    first = json.loads((tmp_path / "first.json").read_text())
    second = json.loads((tmp_path / "second.json").read_text())

    uninterrupted = first["uninterrupted"]
    saved_at = jobs.RESUME_SAVE_EVERY
    assert first["interrupted"][:saved_at + 1] == uninterrupted[:saved_at + 1], "the runs are deterministic"
    assert second["step"] == saved_at and second["rng_restored"] is True
    assert len(second["resumed"]) == jobs.NUM_RESUME_STEPS - saved_at
    assert second["resumed"] == uninterrupted[saved_at:], "bit-identical losses after the resume"
    assert len(set(uninterrupted)) == len(uninterrupted), "losses change every step (the test would be vacuous)"
