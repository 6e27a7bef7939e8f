"""data.gop_window_batches (data/gop_order.py): windows of micro-batches regrouped by video file and frame.

What is held, against references the regrouping does not produce: every window (each rank's share of it) and every
epoch draw exactly the samples StepSampler's formula deals (epoch_permutation, positions round-robin), the drop_last
tail included; the order is a pure function of (seed, epoch, window), so a resume in the middle of a window, on the
same or another world size, repeats and skips nothing and matches the uninterrupted run; micro-batches really hold
fewer files (counted with the files the locations name); windows' micro-batches come in a shuffled order; hostile
values are refused in one line naming data.gop_window_batches; and the training loop resumed from a checkpoint taken
inside a window draws what the uninterrupted run drew.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from embodyhpc.config.schema import DataConfig
from embodyhpc.data import open_dataset
from embodyhpc.data.errors import DatasetError
from embodyhpc.data.gop_order import GopOrderedSampler
from embodyhpc.data.loader import build_dataloader
from embodyhpc.data.sampler import StepSampler, epoch_permutation
from embodyhpc.errors import ConfigError
from tests.data.conftest import FIXTURES

N, MB, W, SEED = 1006, 4, 4, 3  # N: the epoch ends inside a window, with a rank left a slot short (3 ranks)
FRAMES_PER_FILE = 50


def locate(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Files of 50 consecutive frames (as a reader's frame_locations says them)."""
    indices = np.asarray(indices)
    return indices // FRAMES_PER_FILE, indices % FRAMES_PER_FILE


def gop_ranks(world_size: int, *, window: int = W, micro_batch: int = MB, num: int = N,
              epoch: int = 0) -> list[GopOrderedSampler]:
    ranks = [GopOrderedSampler(num, rank=r, world_size=world_size, micro_batch=micro_batch, window_batches=window,
                               locate=locate, seed=SEED) for r in range(world_size)]
    for sampler in ranks:
        sampler.set_epoch(epoch)
    return ranks


def dealt(world_size: int, rank: int, *, num: int = N, epoch: int = 0, start: int = 0) -> list[int]:
    """The reference: StepSampler's formula, position start + rank + k * world_size of the epoch's permutation."""
    draws = (num - start) // world_size
    positions = start + rank + world_size * np.arange(draws)
    return epoch_permutation(positions, num_samples=num, seed=SEED, epoch=epoch).tolist()


def whole_batches(indices: list[int], micro_batch: int = MB) -> list[int]:
    """What a DataLoader with drop_last=True hands out of them."""
    return indices[:len(indices) - len(indices) % micro_batch]


def draw(ranks: list[GopOrderedSampler], micro_batches: int) -> list[list[int]]:
    """`micro_batches` micro-batches per rank, then advance (as the loop's commit does)."""
    got = [list(iter(s))[:micro_batches * s.micro_batch] for s in ranks]
    for sampler in ranks:
        sampler.advance(micro_batches * sampler.micro_batch)
    return got


# ---- the samples drawn: per window, per rank, per epoch, as StepSampler deals them ----
@pytest.mark.parametrize("world_size", [1, 3])
def test_every_window_and_epoch_draw_the_samples_stepsampler_deals(world_size):
    for epoch in (0, 1):
        for rank, sampler in enumerate(gop_ranks(world_size, epoch=epoch)):
            got, want = list(sampler), dealt(world_size, rank, epoch=epoch)
            assert len(got) == len(want) == len(sampler)
            span = W * MB
            for start in range(0, len(want), span):  # each window: the same samples, another order
                assert sorted(got[start:start + span]) == sorted(want[start:start + span]), (epoch, rank, start)
            # the drop_last tail: the same whole micro-batches are drawn, the same incomplete one left out
            assert sorted(whole_batches(got)) == sorted(whole_batches(want))
            assert got != want, "nothing was regrouped"
    every = [i for s in gop_ranks(world_size) for i in s]
    assert len(set(every)) == len(every) == N - N % world_size, "an index repeated"


def test_a_window_of_0_is_stepsamplers_order_and_state_exactly():
    for rank, sampler in enumerate(gop_ranks(2, window=0)):
        plain = StepSampler(N, rank=rank, world_size=2, seed=SEED)
        assert list(sampler) == list(plain) == dealt(2, rank)
        sampler.advance(40)
        plain.advance(40)
        assert sampler.state_dict() == plain.state_dict()


# ---- micro-batches hold fewer files; the window's micro-batches come in a shuffled order ----
def test_micro_batches_hold_fewer_files_and_windows_start_with_any_file():
    def files_per_batch(indices: list[int]) -> float:
        batches = np.asarray(whole_batches(indices)).reshape(-1, MB)
        return float(np.mean([len(set(b // FRAMES_PER_FILE)) for b in batches]))

    plain, grouped = dealt(1, 0), list(gop_ranks(1, window=8)[0])
    assert files_per_batch(grouped) < 0.75 * files_per_batch(plain)
    # a window's smallest file is sorted first; the shuffle must not keep it first (expected 1 window in 8)
    span = 8 * MB
    windows = [grouped[s:s + span] for s in range(0, len(grouped) - span + 1, span)]
    first = [min(w[:MB]) // FRAMES_PER_FILE == min(w) // FRAMES_PER_FILE for w in windows]
    assert sum(first) < len(first) / 2, first
    assert list(gop_ranks(1, window=8)[0]) == grouped, "not deterministic"
    assert list(gop_ranks(1, window=8, epoch=1)[0]) != grouped


def test_the_lerobot_loader_groups_micro_batches_by_video_file():
    """The v2.1 sample (a video file per episode; meta/episodes.jsonl's lengths say which frame is whose): the
    loader's micro-batches of indices hold fewer files, and the same samples."""
    dataset = open_dataset(FIXTURES / "lerobot_v21_sample")
    lengths = [json.loads(line)["length"] for line in (dataset.root / "meta" / "episodes.jsonl").open()]
    episode_of = np.repeat(np.arange(len(lengths)), lengths)

    def files_per_batch(window: int) -> tuple[float, list[int]]:
        data = DataConfig(format="lerobot", root=str(dataset.root), num_workers=0, gop_window_batches=window)
        loader, _ = build_dataloader(dataset, data, micro_batch_size=4, rank=0, world_size=1, seed=1)
        batches = list(loader.batch_sampler)  # what the loader's workers are asked to read, without decoding it
        return float(np.mean([len(set(episode_of[b])) for b in batches])), sorted(i for b in batches for i in b)

    plain, plain_indices = files_per_batch(0)
    grouped, grouped_indices = files_per_batch(3)
    assert grouped_indices == plain_indices and grouped < plain


# ---- resume: in the middle of a window, on the same and on another world size ----
def test_a_resume_inside_a_window_continues_the_uninterrupted_order():
    full = [list(s) for s in gop_ranks(2)]
    ranks = gop_ranks(2)
    before = draw(ranks, 3)  # 3 micro-batches: inside the first window of 4
    state = ranks[0].state_dict()
    resumed = gop_ranks(2)
    for sampler in resumed:
        sampler.load_state_dict(state)
    assert [b + list(s) for b, s in zip(before, resumed, strict=True)] == full
    assert state == ranks[1].state_dict() and state["gop_window"]["base"] == 0


@pytest.mark.parametrize(("new_world_size", "new_micro_batch", "new_window"), [(3, MB, W), (1, 2, 6), (2, MB, 0)])
def test_a_resume_with_another_shape_repeats_and_skips_nothing(new_world_size, new_micro_batch, new_window):
    """Stopped inside window 1 on 2 ranks; resumed on another world size, micro-batch or window: the window is
    finished with the samples it held, later windows follow the permutation, and the epoch draws every index once."""
    ranks = gop_ranks(2)
    before = draw(ranks, 6)  # window 0 (4 micro-batches) and half of window 1
    state = ranks[0].state_dict()
    consumed = state["num_consumed"]
    assert consumed == 2 * 6 * MB
    resumed = gop_ranks(new_world_size, window=new_window, micro_batch=new_micro_batch)
    for sampler in resumed:
        sampler.load_state_dict(state)
    after = [list(s) for s in resumed]
    window_1 = {i for r in range(2) for i in dealt(2, r)[W * MB:2 * W * MB]}  # window 1's samples on 2 ranks
    rest_of_window_1 = window_1 - {i for b in before for i in b[W * MB:]}
    window_end = 2 * W * MB * 2
    finished = {i for r, a in enumerate(after) for i in a[:len(range(consumed + r, window_end, new_world_size))]}
    assert finished == rest_of_window_1
    drawn = [i for part in (before, after) for indices in part for i in indices]
    assert len(set(drawn)) == len(drawn), "a sample repeated"
    tail = (N - consumed) % new_world_size
    assert sorted(drawn) == sorted(epoch_permutation(np.arange(N - tail), num_samples=N, seed=SEED, epoch=0))
    # with drop_last: the epoch's micro-batches hold what StepSampler's hold, the run before and after the resume
    handed_out = [i for b in before for i in b] + [i for a in after for i in whole_batches(a, new_micro_batch)]
    stepsampler = [i for r in range(2) for i in dealt(2, r)[:6 * MB]] + [
        i for r in range(new_world_size) for i in whole_batches(dealt(new_world_size, r, start=consumed),
                                                                 new_micro_batch)]
    assert sorted(handed_out) == sorted(stepsampler)

    # a second resume, inside a window of the new shape, continues that run exactly
    resumed_again = gop_ranks(new_world_size, window=new_window, micro_batch=new_micro_batch)
    for sampler in resumed_again:
        sampler.load_state_dict(state)
    middle = draw(resumed_again, 3)
    second = resumed_again[0].state_dict()
    again = gop_ranks(new_world_size, window=new_window, micro_batch=new_micro_batch)
    for sampler in again:
        sampler.load_state_dict(second)
    assert [m + list(s) for m, s in zip(middle, again, strict=True)] == after


def test_a_state_with_a_broken_window_is_refused():
    state = gop_ranks(2)[0].state_dict()
    for bad in ({"base": 0}, {**state["gop_window"], "world_size": 0}, {**state["gop_window"], "base": "0"}):
        with pytest.raises(DatasetError, match="gop_window"):
            gop_ranks(2)[0].load_state_dict({**state, "gop_window": bad})
    plain = StepSampler(N, rank=0, world_size=2, seed=SEED)
    with pytest.raises(DatasetError, match="gop_window_batches"):
        plain.load_state_dict(state)


# ---- hostile values ----
@pytest.mark.parametrize("value", [-1, 65, 10**9, 2.5, True, "8", None])
def test_hostile_window_values_are_refused_in_one_line(value):
    with pytest.raises(ConfigError) as caught:
        DataConfig(format="lerobot", root="/data", gop_window_batches=value)
    text = str(caught.value)
    assert "data.gop_window_batches" in text and "\n" not in text


@pytest.mark.parametrize("data_format", ["synthetic", "hdf5"])
def test_a_window_without_video_files_is_refused_in_one_line(data_format):
    with pytest.raises(ConfigError) as caught:
        DataConfig(format=data_format, root="/data", gop_window_batches=8)
    assert "data.gop_window_batches" in str(caught.value) and "\n" not in str(caught.value)
    assert DataConfig(format=data_format, root="/data").gop_window_batches == 0


def test_a_reader_that_cannot_locate_frames_is_refused_with_a_window():
    class Numbers:
        def __len__(self) -> int:
            return 10

        def __getitem__(self, index: int) -> int:
            return index

    with pytest.raises(ConfigError, match="data.gop_window_batches"):
        build_dataloader(Numbers(), DataConfig(format="lerobot", root="/data", num_workers=0, gop_window_batches=2),
                         micro_batch_size=2, rank=0, world_size=1, seed=0)
    loader, sampler = build_dataloader(Numbers(), DataConfig(num_workers=0), micro_batch_size=2, rank=0,
                                       world_size=1, seed=0)
    assert type(sampler) is StepSampler


# ---- the training loop: resumed inside a window, it draws what the uninterrupted run drew ----
def gop_train_job(rank: int, world_size: int, run_dir: str, steps: int, every_steps: int) -> dict[str, Any]:
    """tests/train/workers.train_job with data.gop_window_batches=3 (the window: 3 micro-batches of 2 samples per
    rank, so a checkpoint after step 2 on 2 ranks, 16 positions, lies inside the window [12, 24))."""
    from embodyhpc.config.resolve import resolve
    from embodyhpc.train import loop
    from embodyhpc.train.loop import train
    from tests.train import workers

    class Recording(workers.RecordingDataset):
        def frame_locations(self, indices):
            return self.inner.frame_locations(indices)

    cfg = workers.recipe(world_size, steps=steps, every_steps=every_steps)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, gop_window_batches=3))
    drawn: list[int] = []
    open_dataset_ = loop._open
    loop._open = lambda data, model_cfg, *seed: Recording(open_dataset_(data, model_cfg, *seed), drawn)
    result = train(cfg, resolve(cfg), run_dir=run_dir, dist_env=SimpleNamespace(rank=rank, world_size=world_size,
                   local_rank=rank), device="cpu", config_yaml="model: {size: tiny}\n")
    return {"start_step": result.start_step, "drawn": drawn}


@pytest.mark.slow  # 3 training jobs of 2 ranks: ~6 s here
def test_the_training_loop_resumed_inside_a_window_draws_the_uninterrupted_samples(tmp_path):
    from tests.parallel.harness import run_ranks

    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    full = run_ranks(gop_train_job, 2, str(full_dir), 4, 2, timeout_s=240)
    (resumed_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(full_dir / "checkpoints" / "step-2", resumed_dir / "checkpoints" / "step-2")
    resumed = run_ranks(gop_train_job, 2, str(resumed_dir), 4, 2, timeout_s=240)
    assert [r["start_step"] for r in resumed] == [2, 2]
    per_rank = 2 * 2 * 2  # 2 steps x 2 micro-batches x 2 samples
    assert [r["drawn"] for r in resumed] == [r["drawn"][per_rank:] for r in full]
    saved = json.loads((full_dir / "checkpoints" / "step-2" / "trainer.json").read_text())["sampler"]
    assert saved["num_consumed"] == 16 and saved["gop_window"] == {  # inside the window [12, 24)
        "base": 0, "world_size": 2, "micro_batch": 2, "window_batches": 3}
    # windows 0 and 1 (3 micro-batches of 2 per rank each): each rank's share as StepSampler deals it, regrouped
    num = len(open_dataset(FIXTURES / "lerobot_v30_sample"))
    order = epoch_permutation(np.arange(24), num_samples=num, seed=3, epoch=0).tolist()
    for rank, result in enumerate(full):
        assert sorted(result["drawn"][:6]) == sorted(order[rank:12:2])
        assert sorted(result["drawn"][6:12]) == sorted(order[12 + rank:24:2])
    assert [r["drawn"][:12] for r in full] != [order[rank:24:2] for rank in range(2)], "nothing was regrouped"
