"""The loader reads step folders as the planner does (one parser, the folder's own record): a `step-8` holding
step 4's checkpoint fails the load in one line instead of training on from step 8; near-miss names are no steps."""

from __future__ import annotations

import shutil

import pytest
import torch

from embodyhpc.checkpoint import Checkpointer, CheckpointError, layout
from embodyhpc.config.schema import CheckpointConfig

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _saved_at_step_4(root):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    with Checkpointer(root, CheckpointConfig(every_steps=1, keep_latest_k=3, async_save=False)) as ckpt:
        ckpt.save(4, model, optimizer)
    return model, optimizer


def test_a_folder_named_for_a_later_step_than_its_record_fails_the_load(tmp_path):
    model, optimizer = _saved_at_step_4(tmp_path)
    shutil.copytree(tmp_path / "step-4", tmp_path / "step-8")  # copied by hand under a newer name
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep_latest_k=3)) as ckpt:
        assert ckpt.newest_complete_step() == 8
        with pytest.raises(CheckpointError) as caught:
            ckpt.load_latest(model, optimizer)
    message = str(caught.value)
    assert "step-8 cannot be resumed from" in message and "records step 4" in message and "\n" not in message


def test_near_miss_names_are_no_steps_to_the_loader_either(tmp_path):
    model, optimizer = _saved_at_step_4(tmp_path)
    for name in ("step-0008", "step-+9", f"step-{2 ** 63}"):
        shutil.copytree(tmp_path / "step-4", tmp_path / name)
    assert layout.list_steps(tmp_path).complete == [4]
    with Checkpointer(tmp_path, CheckpointConfig(every_steps=1, keep_latest_k=3)) as ckpt:
        loaded = ckpt.load_latest(model, optimizer)
    assert loaded is not None and loaded.step == 4 and loaded.trainer.step == 4
