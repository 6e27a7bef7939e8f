"""A rank killed (SIGKILL) in the middle of an async save: the previous checkpoint stays complete and is what a
restart resumes from; `latest` never names the partial folder."""

from __future__ import annotations

import pytest
from torch.multiprocessing.spawn import ProcessException

from embodyhpc.checkpoint import Checkpointer, layout
from embodyhpc.config.schema import CheckpointConfig
from tests.checkpoint import jobs
from tests.checkpoint.distributed import run_ranks, sharded_model


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # the one-process restart
def test_kill_one_rank_during_async_save_keeps_the_previous_checkpoint(tmp_path):
    with pytest.raises(ProcessException):
        run_ranks(jobs.killed_during_async_save_job, 2, str(tmp_path))
    root = tmp_path / "checkpoints"
    listing = layout.list_steps(root)
    assert listing.complete == [1]
    assert listing.incomplete == [2], "the half-written step stays unmarked"
    assert layout.read_latest(root) == root / "step-1"

    model, optimizer = sharded_model(init_seed=7)  # the restart (one process here: any world size loads it)
    loaded = Checkpointer(root, CheckpointConfig(every_steps=1, keep_latest_k=2)).load_latest(model, optimizer)
    assert loaded.step == 1 and loaded.saved_world_size == 2
