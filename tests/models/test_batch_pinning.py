"""Every model plug-in's batch is pinned by torch's own pin path (the DataLoader's pin-memory thread calls
torch.utils.data._utils.pin_memory.pin_memory, which calls `.pin_memory()` on objects that have it; a batch type
without it would come back unpinned, and every step's images would be copied from pageable memory).

Under the CUDA double (tests/cuda_doubles.py), for the batch each plug-in's collate builds from LeRobot-style items
and for its smoke batch: every tensor the batch's own `to()` moves to a device is pinned, with its values, dtype
and shape unchanged; the tensors `to()` leaves on the host are left as they are (not pinned: they never travel).
Which tensors travel is read from `to("meta")`, not from a list kept here.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory

from embodyhpc.models import available_models, build_tokenizer, model_spec


def _items(cfg, count: int = 3) -> list[dict]:
    """LeRobot-style dataset items (two cameras, a 6-d state, a padded action chunk, an instruction)."""
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(count):
        is_pad = torch.zeros(cfg.action_horizon, dtype=torch.bool)
        is_pad[cfg.action_horizon - i:] = True
        items.append({"observation.images.top": torch.rand(3, 24, 24, generator=g),
                      "observation.images.wrist": torch.rand(3, 24, 24, generator=g),
                      cfg.state_key: torch.rand(6, generator=g) * 2 - 1,
                      "action": torch.randn(cfg.action_horizon, cfg.action_dim - 2, generator=g),
                      "action_is_pad": is_pad, "task": " ".join(["pick up the red cup"] * (i + 1))})
    return items


def _batches(name: str) -> dict[str, object]:
    """The batches a plug-in's training sees: its collate's (what the DataLoader pins) and its smoke batch."""
    spec = model_spec(name)
    assert spec.smoke is not None, (f"model {name!r} has no smoke in its spec: this test builds its model config "
                                    "from it; give it one (models/protocol.SmokeModel)")
    smoke = spec.load("smoke")
    cfg = smoke.config(smoke.sizes[0], "auto")
    collate = spec.load("collate")(cfg, build_tokenizer(cfg), None)
    return {"collate": collate(_items(cfg)), "smoke": smoke.fixed_batch(cfg, 0)[0]}


def _tensor_fields(batch) -> dict[str, torch.Tensor]:
    assert is_dataclass(batch), type(batch)
    return {f.name: getattr(batch, f.name) for f in fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)}


CASES = [(name, source) for name in available_models() for source in ("collate", "smoke")]


@pytest.mark.parametrize(("name", "source"), CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_torchs_pin_path_pins_every_tensor_the_batch_moves(fake_cuda, name, source) -> None:
    batch = _batches(name)[source]
    tensors = _tensor_fields(batch)
    on_meta = _tensor_fields(batch.to("meta"))
    travelling = {k for k, v in on_meta.items() if v.device.type == "meta"}
    host = set(tensors) - travelling
    assert "images" in travelling and travelling, (name, sorted(tensors))
    assert all(tensors[k].device.type == "cpu" for k in tensors)

    cuda = fake_cuda(1)
    pinned = pin_memory(batch)  # what the DataLoader's pin-memory thread runs on each batch

    assert type(pinned) is type(batch)
    result = _tensor_fields(pinned)
    assert set(result) == set(tensors)
    assert sorted(k for k in travelling if not cuda.is_pinned(result[k])) == []
    for key, value in result.items():
        want = tensors[key]
        assert value.dtype == want.dtype and value.shape == want.shape and torch.equal(value, want), key
    for key in host:  # left on the host by to(): left as it was
        assert result[key] is tensors[key] and not cuda.is_pinned(result[key]), key
    distinct = {id(tensors[k]) for k in travelling}
    assert sum(1 for event in cuda.events if event[0] == "pin") == len(distinct)
    for f in fields(batch):  # everything else (rows, ...) comes through as it was
        if f.name not in tensors:
            assert getattr(pinned, f.name) == getattr(batch, f.name), f.name
    # the pinned batch still moves as the original does
    assert {k for k, v in _tensor_fields(pinned.to("meta")).items() if v.device.type == "meta"} == travelling


def test_groot_pins_a_shared_tensor_once(fake_cuda) -> None:
    from embodyhpc.models.groot.batch import GrootBatch

    cuda = fake_cuda(1)
    mask = torch.ones(2, 4, dtype=torch.bool)  # horizon 4 and 4 action dims: one tensor may serve both masks
    batch = GrootBatch(images=torch.rand(2, 1, 3, 4, 4), text_ids=torch.zeros(2, 3, dtype=torch.long),
                       text_lengths=torch.tensor([3, 2]), state=torch.rand(2, 8),
                       embodiment=torch.full((2,), 31), actions=torch.rand(2, 4, 4), action_is_pad=mask,
                       action_dim_mask=mask, rows=[[0, 1]])
    pinned = batch.pin_memory()
    assert pinned.action_is_pad is pinned.action_dim_mask and cuda.is_pinned(pinned.action_is_pad)
    assert pinned.rows is batch.rows and pinned.text_lengths is batch.text_lengths
    # images, text_ids, state, embodiment, actions, and the mask once
    assert sum(1 for event in cuda.events if event[0] == "pin") == 6
