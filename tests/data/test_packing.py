"""Packing: placement, the boundary tensors attention consumes, efficiency numbers, the collate function."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from embodyhpc.data.packing import (
    PAD_SEGMENT_ID,
    PackingCollator,
    PackingError,
    SampleTokens,
    first_fit_decreasing,
    next_fit,
    pack_samples,
    packing_stats,
)


def random_samples(rng: random.Random, num_samples: int, budget_tokens: int) -> list[SampleTokens]:
    samples = []
    for _ in range(num_samples):
        num_action_tokens = rng.randint(0, budget_tokens // 4)
        num_text_tokens = rng.randint(1, budget_tokens // 2 - num_action_tokens // 2)
        samples.append(SampleTokens(num_image_tokens=rng.choice([0, budget_tokens // 8, budget_tokens // 4]),
                                    num_text_tokens=num_text_tokens, num_state_tokens=rng.randint(0, 2),
                                    num_action_tokens=num_action_tokens))
    return samples


def skewed_lengths(rng: random.Random, num_samples: int) -> list[int]:
    """Mostly short samples (one camera, short instruction), a few long ones (three cameras, long instruction)."""
    return [rng.randint(600, 1000) if rng.random() < 0.15 else rng.randint(60, 260) for _ in range(num_samples)]


def test_hand_checked_small_example() -> None:
    lengths = [6, 5, 4, 3, 2]
    assert first_fit_decreasing(lengths, 10) == [[0, 2], [1, 3, 4]]
    assert next_fit(lengths, 10) == [[0], [1, 2], [3, 4]]
    stats = packing_stats(lengths, first_fit_decreasing(lengths, 10), 10)
    assert (stats.num_real_tokens, stats.num_rows, stats.min_num_rows, stats.longest_sample_tokens) == (20, 2, 2, 6)
    assert stats.packing_efficiency == 1.0
    assert stats.padding_efficiency == pytest.approx(20 / 30)
    assert packing_stats(lengths, next_fit(lengths, 10), 10).packing_efficiency == pytest.approx(20 / 30)


def test_hand_checked_mix_where_order_matters() -> None:
    lengths = [7, 7, 7, 1, 1, 1]
    ffd = packing_stats(lengths, first_fit_decreasing(lengths, 8), 8)
    naive = packing_stats(lengths, next_fit(lengths, 8), 8)
    assert (ffd.num_rows, ffd.packing_efficiency) == (3, 1.0)
    assert (naive.num_rows, naive.packing_efficiency) == (4, 0.75)
    assert ffd.padding_efficiency == pytest.approx(24 / 42)


def test_layout_tensors_hand_checked() -> None:
    samples = [SampleTokens(num_image_tokens=2, num_text_tokens=1, num_action_tokens=2),  # 5 tokens, prefix 3
               SampleTokens(num_text_tokens=2, num_action_tokens=1),  # 3 tokens, prefix 2
               SampleTokens(num_image_tokens=1, num_action_tokens=1)]  # 2 tokens, prefix 1
    packed = pack_samples(samples, 6)
    assert packed.rows == [[0], [1, 2]]
    assert packed.segment_ids.dtype == torch.int32 and packed.cu_seqlens.dtype == torch.int32
    assert packed.segment_ids.tolist() == [[0, 0, 0, 0, 0, -1], [0, 0, 0, 1, 1, -1]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 0]]
    assert packed.cu_seqlens.tolist() == [[0, 5, 5], [0, 3, 5]]
    assert packed.num_segments.tolist() == [1, 2]
    assert packed.prefix_lens.tolist() == [[3, 0], [2, 1]]
    assert packed.segment_sample_index.tolist() == [[0, -1], [1, 2]]
    assert packed.max_seqlen == 5
    flat, flat_max = packed.flat_cu_seqlens()
    assert flat.dtype == torch.int32 and flat.tolist() == [0, 5, 6, 9, 11, 12] and flat_max == 5
    assert packed.dense_attention_mask()[1].int().tolist() == [
        [1, 1, 0, 0, 0, 0],  # sample 1's prefix sees its prefix only
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],  # its action token sees the prefix and itself
        [0, 0, 0, 1, 0, 0],  # sample 2's prefix
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding sees only itself
    ]


@pytest.mark.parametrize("seed", range(5))
def test_every_sample_once_within_budget_and_boundaries_consistent(seed: int) -> None:
    rng = random.Random(seed)
    budget = 256
    samples = random_samples(rng, rng.randint(1, 60), budget)
    packed = pack_samples(samples, budget)
    placed = sorted(i for row in packed.rows for i in row)
    assert placed == list(range(len(samples)))
    for r, row in enumerate(packed.rows):
        lengths = [samples[i].num_tokens for i in row]
        assert sum(lengths) <= budget
        n = int(packed.num_segments[r])
        assert n == len(row)
        cu = packed.cu_seqlens[r].tolist()
        assert cu[0] == 0 and cu[1:n + 1] == [sum(lengths[:k + 1]) for k in range(n)]
        assert all(v == cu[n] for v in cu[n:])
        segment_ids = packed.segment_ids[r]
        for slot in range(n):
            tokens = (segment_ids == slot).nonzero().flatten()
            assert tokens.tolist() == list(range(cu[slot], cu[slot + 1]))
            assert packed.position_ids[r, tokens].tolist() == list(range(lengths[slot]))
            assert int(packed.prefix_lens[r, slot]) == samples[row[slot]].num_prefix_tokens
        assert int((segment_ids == PAD_SEGMENT_ID).sum()) == budget - cu[n]
    assert packed.max_seqlen == max(s.num_tokens for s in samples)
    flat, flat_max = packed.flat_cu_seqlens()
    assert flat[-1] == len(packed.rows) * budget and bool((flat[1:] > flat[:-1]).all())
    assert flat_max == int((flat[1:] - flat[:-1]).max()) >= packed.max_seqlen


def test_deterministic() -> None:
    samples = random_samples(random.Random(3), 40, 128)
    a, b = pack_samples(samples, 128), pack_samples(list(samples), 128)
    assert a.rows == b.rows
    assert torch.equal(a.segment_ids, b.segment_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)


@pytest.mark.parametrize("seed", range(20))
def test_ffd_never_worse_than_naive_on_random_lengths(seed: int) -> None:
    rng = random.Random(seed)
    budget = 1024
    draws = {"uniform": lambda: rng.randint(1, budget), "short": lambda: rng.randint(50, 400),
             "lognormal": lambda: min(budget, max(1, int(rng.lognormvariate(5.0, 0.8))))}
    for draw in draws.values():
        lengths = [draw() for _ in range(rng.randint(10, 200))]
        ffd, naive = first_fit_decreasing(lengths, budget), next_fit(lengths, budget)
        assert len(ffd) <= len(naive)
        min_rows = packing_stats(lengths, ffd, budget).min_num_rows
        assert len(ffd) <= 11 * min_rows // 9 + 1  # FFD's worst-case bound, against a lower bound of OPT


def test_efficiency_on_a_skewed_mix() -> None:
    lengths = skewed_lengths(random.Random(0), 256)
    stats = packing_stats(lengths, first_fit_decreasing(lengths, 2048), 2048)
    assert stats.num_rows <= stats.min_num_rows + 1  # only the last row is partly empty
    assert stats.packing_efficiency > 0.96
    assert stats.padding_efficiency < 0.4  # what pad-to-longest would have wasted on the same micro-batch


def test_oversize_sample_is_named() -> None:
    with pytest.raises(PackingError, match="sample 2 has 11 tokens, more than the budget of 10 tokens per row"):
        first_fit_decreasing([3, 4, 11, 2], 10)
    with pytest.raises(PackingError, match="sample 1 has 12 tokens"):
        pack_samples([SampleTokens(num_text_tokens=1), SampleTokens(num_image_tokens=10, num_action_tokens=2)], 10)
    with pytest.raises(PackingError, match="no samples"):
        first_fit_decreasing([], 10)
    with pytest.raises(ValueError, match="not all 0"):
        SampleTokens()


def test_packed_attention_equals_attention_per_sample() -> None:
    """The mask the layout describes gives each sample exactly the attention it would get alone."""
    torch.manual_seed(0)
    samples = random_samples(random.Random(1), 12, 64)
    packed = pack_samples(samples, 64)
    dim = 8
    alone = [torch.randn(s.num_tokens, dim) for s in samples]
    packed_x = torch.zeros(len(packed.rows), 64, dim)
    for r, row in enumerate(packed.rows):
        for slot, index in enumerate(row):
            packed_x[r, int(packed.cu_seqlens[r, slot]):int(packed.cu_seqlens[r, slot + 1])] = alone[index]
    out = F.scaled_dot_product_attention(packed_x, packed_x, packed_x, attn_mask=packed.dense_attention_mask())
    for r, row in enumerate(packed.rows):
        for slot, index in enumerate(row):
            n, p = samples[index].num_tokens, samples[index].num_prefix_tokens
            key_is_prefix = torch.arange(n) < p
            mask = key_is_prefix[None, :] | ~key_is_prefix[:, None]
            expected = F.scaled_dot_product_attention(alone[index], alone[index], alone[index], attn_mask=mask)
            got = out[r, int(packed.cu_seqlens[r, slot]):int(packed.cu_seqlens[r, slot + 1])]
            torch.testing.assert_close(got, expected)
    assert not out.isnan().any()


class TokenDataset(Dataset):
    def __init__(self, num_samples: int) -> None:
        self.samples = random_samples(random.Random(7), num_samples, 96)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        layout = self.samples[index]
        n = layout.num_tokens
        return {"tokens_layout": layout, "input_ids": torch.arange(n) + 1000 * index,
                "embeds": torch.full((n, 3), float(index)), "loss_mask": torch.arange(n) >= layout.num_prefix_tokens,
                "action": torch.full((4, 2), float(index)), "task": f"task {index}"}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_collator_packs_token_tensors_in_a_dataloader(num_workers: int) -> None:
    dataset = TokenDataset(24)
    collate = PackingCollator(96, {"input_ids": 0, "embeds": 0.0, "loss_mask": False})
    loader = DataLoader(dataset, batch_size=8, collate_fn=collate, num_workers=num_workers)
    for batch_number, batch in enumerate(loader):
        indices = list(range(8 * batch_number, 8 * batch_number + 8))
        num_rows = batch["segment_ids"].shape[0]
        assert batch["input_ids"].shape == (num_rows, 96) and batch["input_ids"].dtype == torch.int64
        assert batch["embeds"].shape == (num_rows, 96, 3) and batch["loss_mask"].dtype == torch.bool
        assert batch["action"].shape == (8, 4, 2) and batch["task"] == [f"task {i}" for i in indices]
        assert batch["packing_stats"].num_samples == 8 and 0 < batch["packing_stats"].packing_efficiency <= 1
        for r in range(num_rows):
            for slot in range(int(batch["num_segments"][r])):
                local = int(batch["segment_sample_index"][r, slot])
                start, end = int(batch["cu_seqlens"][r, slot]), int(batch["cu_seqlens"][r, slot + 1])
                item = dataset[indices[local]]
                assert torch.equal(batch["input_ids"][r, start:end], item["input_ids"])
                assert torch.equal(batch["embeds"][r, start:end], item["embeds"])
                assert torch.equal(batch["loss_mask"][r, start:end], item["loss_mask"])
                assert torch.equal(batch["action"][local], item["action"])
        is_pad = batch["segment_ids"] == PAD_SEGMENT_ID
        assert int(batch["input_ids"][is_pad].abs().sum()) == 0 and not batch["loss_mask"][is_pad].any()


def test_collator_rejects_tokens_that_disagree_with_the_layout() -> None:
    item = TokenDataset(1)[0]
    item["input_ids"] = item["input_ids"][:-1]
    with pytest.raises(PackingError, match="sample 0: 'input_ids' has"):
        PackingCollator(96, {"input_ids": 0})([item])
