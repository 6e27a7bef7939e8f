"""StepSampler: determinism, disjoint ranks, exact resume on another world size, DataLoader use, checkpointing."""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

from embodyhpc.data.errors import DatasetError
from embodyhpc.data.sampler import StepSampler, epoch_permutation


def samplers(num_samples: int, world_size: int, **kwargs) -> list[StepSampler]:
    return [StepSampler(num_samples, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


def draw(ranks: list[StepSampler], num_per_rank: int | None = None) -> list[list[int]]:
    """What each rank yields in lockstep (all of its share, or the first num_per_rank), then advance() by it."""
    draws = [list(s)[:num_per_rank] if num_per_rank is not None else list(s) for s in ranks]
    assert len({len(d) for d in draws}) == 1, "ranks out of lockstep"
    for s, d in zip(ranks, draws, strict=True):
        s.advance(len(d))
    return draws


class IndexDataset(Dataset):
    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize("num_samples", [1, 2, 5, 16, 17, 1000, 12_345])
def test_epoch_permutation_is_a_bijection(num_samples: int) -> None:
    order = epoch_permutation(np.arange(num_samples), num_samples=num_samples, seed=7, epoch=3)
    assert sorted(order.tolist()) == list(range(num_samples))


def test_permutation_looks_shuffled() -> None:
    order = epoch_permutation(np.arange(1000), num_samples=1000, seed=0, epoch=0)
    assert abs(np.corrcoef(np.arange(1000), order)[0, 1]) < 0.1
    firsts = Counter(int(epoch_permutation(np.arange(1), num_samples=10, seed=s, epoch=0)[0]) for s in range(2000))
    assert min(firsts.values()) > 140 and max(firsts.values()) < 260  # each index ~200 times as the first draw


def test_deterministic_from_seed_and_epoch() -> None:
    first = [list(s) for s in samplers(1000, 3, seed=5)]
    again = [list(s) for s in samplers(1000, 3, seed=5)]
    assert first == again
    assert [list(s) for s in samplers(1000, 3, seed=6)] != first
    other_epoch = samplers(1000, 3, seed=5)
    for s in other_epoch:
        s.set_epoch(1)
    assert [list(s) for s in other_epoch] != first


def test_shuffle_false_is_dataset_order() -> None:
    assert [list(s) for s in samplers(7, 2, shuffle=False)] == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("num_samples", [1, 4, 7, 60, 61, 997])
def test_disjoint_and_covering_drop(world_size: int, num_samples: int) -> None:
    draws = draw(samplers(num_samples, world_size, seed=1))
    flat = [i for d in draws for i in d]
    assert len(flat) == len(set(flat)), "a sample drawn twice"
    assert len(flat) == num_samples - num_samples % world_size  # fewer than world_size left out
    order = epoch_permutation(np.arange(num_samples), num_samples=num_samples, seed=1, epoch=0).tolist()
    assert set(flat) == set(order[: len(flat)])  # what is left out is the tail of the permutation


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("num_samples", [1, 4, 7, 60, 61, 997])
def test_disjoint_and_covering_wrap(world_size: int, num_samples: int) -> None:
    draws = draw(samplers(num_samples, world_size, seed=1, tail="wrap"))
    counts = Counter(i for d in draws for i in d)
    assert set(counts) == set(range(num_samples)), "a sample never drawn"
    assert sum(c - 1 for c in counts.values()) == -num_samples % world_size  # fewer than world_size extra draws
    if num_samples >= world_size:
        assert max(counts.values()) <= 2


def test_lockstep_draws_are_disjoint_at_every_step() -> None:
    ranks = samplers(100, 4, seed=2)
    iterators = [iter(s) for s in ranks]
    seen: set[int] = set()
    for _ in range(25):
        step = [next(it) for it in iterators]
        assert len(set(step)) == 4 and not seen & set(step)
        seen |= set(step)


@pytest.mark.parametrize("num_samples", [97, 100, 1001])
@pytest.mark.parametrize("new_world_size", [1, 3, 2, 5])
@pytest.mark.parametrize("tail", ["drop", "wrap"])
def test_resume_on_another_world_size_neither_repeats_nor_skips(num_samples: int, new_world_size: int,
                                                                tail: str) -> None:
    before = samplers(num_samples, 2, seed=11, tail=tail)
    for s in before:
        s.set_epoch(4)
    pre = draw(before, num_per_rank=23)
    state = before[0].state_dict()
    assert all(s.state_dict() == state for s in before)

    after = samplers(num_samples, new_world_size, seed=11, tail=tail)
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(4)  # what a training loop does at the top of the resumed epoch: must not rewind
    post = draw(after)

    drawn = [i for d in pre + post for i in d]
    order = epoch_permutation(np.arange(num_samples), num_samples=num_samples, seed=11, epoch=4).tolist()
    num_left = num_samples - 2 * 23
    if tail == "drop":
        assert len(drawn) == len(set(drawn)), "a sample repeated across the resume"
        assert sorted(drawn) == sorted(order[: num_samples - num_left % new_world_size])
    else:
        counts = Counter(drawn)
        assert set(counts) == set(range(num_samples)), "a sample skipped across the resume"
        assert sum(c - 1 for c in counts.values()) == -num_left % new_world_size


def test_two_resumes_chain() -> None:
    run1 = samplers(500, 2, seed=3)
    drawn = draw(run1, 40)
    run2 = samplers(500, 3, seed=3)
    for s in run2:
        s.load_state_dict(run1[0].state_dict())
    drawn += draw(run2, 50)
    run3 = samplers(500, 1, seed=3)
    run3[0].load_state_dict(run2[1].state_dict())
    drawn += draw(run3)
    flat = [i for d in drawn for i in d]
    assert sorted(flat) == list(range(500))


def test_set_epoch_restarts_a_new_epoch_and_len_follows_state() -> None:
    s = StepSampler(10, rank=0, world_size=3, seed=0)
    assert len(s) == 3
    s.advance(2)
    assert len(s) == 1 and s.num_consumed == 6
    s.set_epoch(0)
    assert len(s) == 1
    s.set_epoch(1)
    assert len(s) == 3 and s.num_consumed == 0


def test_advance_past_the_epoch_is_refused() -> None:
    s = StepSampler(10, rank=0, world_size=3)
    with pytest.raises(ValueError, match="has 3 samples left in epoch 0"):
        s.advance(4)


def test_state_round_trips_through_torch_save() -> None:
    s = StepSampler(1234, rank=1, world_size=4, seed=9, tail="wrap")
    s.set_epoch(2)
    s.advance(17)
    buffer = io.BytesIO()
    torch.save(s.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    restored = StepSampler(1234, rank=1, world_size=4, seed=9, tail="wrap")
    restored.load_state_dict(state)
    assert restored.state_dict() == s.state_dict()
    assert list(restored) == list(s)


@pytest.mark.parametrize("key,value", [("seed", 8), ("num_samples", 99)])
def test_state_from_another_dataset_or_seed_is_refused(key: str, value: int) -> None:
    s = StepSampler(100, rank=0, world_size=1, seed=7)
    state = {**s.state_dict(), key: value}
    with pytest.raises(DatasetError, match=f"{key}={value}"):
        s.load_state_dict(state)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="rank"):
        StepSampler(10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="tail"):
        StepSampler(10, rank=0, world_size=1, tail="pad")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_samples"):
        StepSampler(0, rank=0, world_size=1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_with_sampler_and_batch_size(num_workers: int) -> None:
    ranks = samplers(103, 2, seed=4)
    loaders = [DataLoader(IndexDataset(103), sampler=s, batch_size=8, num_workers=num_workers) for s in ranks]
    batches = [[b.tolist() for b in loader] for loader in loaders]
    assert [len(b) for b in batches] == [len(loader) for loader in loaders] == [7, 7]
    assert batches == [[d[i:i + 8] for i in range(0, len(d), 8)] for d in (list(s) for s in ranks)]
    flat = [i for rank in batches for b in rank for i in b]
    assert len(flat) == len(set(flat)) == 102


def test_dataloader_with_batch_sampler_resumes_mid_epoch() -> None:
    """The real loop: prefetching workers run ahead, the trainer advances by what it consumed, then resumes."""
    dataset = IndexDataset(200)
    before = samplers(200, 2, seed=6)
    iterators = [iter(DataLoader(dataset, batch_sampler=BatchSampler(s, 5, drop_last=False), num_workers=2))
                 for s in before]
    consumed = []
    for _ in range(3):  # three steps of 5 samples per rank; workers have prefetched more by now
        for s, it in zip(before, iterators, strict=True):
            consumed += next(it).tolist()
            s.advance(5)
    del iterators
    state = before[0].state_dict()
    after = samplers(200, 3, seed=6)
    for s in after:
        s.load_state_dict(state)
    for s in after:
        consumed += [i for b in DataLoader(dataset, batch_sampler=BatchSampler(s, 5, drop_last=False),
                                           num_workers=2) for i in b.tolist()]
    assert len(consumed) == len(set(consumed)) == 30 + 3 * (170 // 3)
