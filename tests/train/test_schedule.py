"""Warm-up + cosine: the values at the boundaries, and that LambdaLR applies them to the steps we mean."""

from __future__ import annotations

import math

import pytest
import torch

from embodyhpc.train.schedule import warmup_cosine


def test_boundaries():
    fn = warmup_cosine(warmup_steps=4, total_steps=14)
    assert fn(0) == pytest.approx(1 / 5)  # the first step already moves
    assert fn(3) == pytest.approx(4 / 5)
    assert fn(4) == 1.0  # the peak, right after warm-up
    assert fn(9) == pytest.approx(0.5)  # half-way through the decay
    assert fn(14) == pytest.approx(0.0, abs=1e-12)  # after the last step
    assert fn(20) == pytest.approx(0.0, abs=1e-12)  # clamped, never negative or rising again
    assert fn(6) == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 10)))


def test_no_warmup_starts_at_peak():
    fn = warmup_cosine(0, 10)
    assert fn(0) == 1.0 and fn(10) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(("warmup", "total"), [(5, 5), (-1, 5), (0, 0)])
def test_refuses_impossible_schedules(warmup, total):
    with pytest.raises(ValueError):
        warmup_cosine(warmup, total)


def test_lambdalr_resumed_mid_run_matches_uninterrupted():
    """The loop rebuilds the scheduler at the resumed step instead of saving its state."""
    fn = warmup_cosine(2, 8)

    def fresh_optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)

    optimizer = fresh_optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
    uninterrupted = []
    for _ in range(8):
        uninterrupted.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    resumed_optimizer = fresh_optimizer()
    resumed_optimizer.param_groups[0]["initial_lr"] = 0.1
    resumed = torch.optim.lr_scheduler.LambdaLR(resumed_optimizer, fn, last_epoch=5 - 1)
    tail = []
    for _ in range(3):
        tail.append(resumed_optimizer.param_groups[0]["lr"])
        resumed_optimizer.step()
        resumed.step()
    assert tail == pytest.approx(uninterrupted[5:])
    assert uninterrupted[0] == pytest.approx(0.1 / 3) and uninterrupted[2] == pytest.approx(0.1)
