"""Policy versions and staleness: the counter never goes back, and no admitted sample is older than max_staleness."""

from __future__ import annotations

import random

import numpy as np
import pytest

from embodyhpc.rl.samples import ChunkSample, EpisodeEnd, StalenessGate, VersionCounter, admit, staleness


def test_version_counter_is_monotonic_and_survives_as_an_int() -> None:
    counter = VersionCounter()
    assert [counter.advance() for _ in range(3)] == [1, 2, 3]
    saved = int(counter)
    restored = VersionCounter(saved)  # what a resume does with the int it saved
    assert restored.value == 3 and restored.advance() == 4
    assert restored.set(7) == 7 and restored.set(7) == 7  # a received version may repeat, never go back
    with pytest.raises(ValueError, match="may not go back from 7 to 6"):
        restored.set(6)
    assert restored.value == 7
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="integer >= 0"):
            VersionCounter(bad)  # type: ignore[arg-type]


def test_no_admitted_sample_is_older_than_max_staleness() -> None:
    """Property over random streams: the actor's version advances, rollouts deliver samples of random past
    versions; every admitted sample is at most max_staleness behind, every one exactly at the bound is admitted
    (an off-by-one either way fails), and the gate's counts equal a count made here."""
    rng = random.Random(31)
    for _ in range(200):
        max_staleness = rng.randrange(0, 4)
        gate = StalenessGate(max_staleness)
        actor = VersionCounter(rng.randrange(0, 5))
        lags = []
        for _ in range(rng.randrange(1, 30)):
            if rng.random() < 0.3:
                actor.advance()
            sample_version = rng.randrange(0, actor.value + 1)
            lag = actor.value - sample_version  # the definition, independently of staleness()
            lags.append(lag)
            ok = gate.admit(sample_version, actor.value)
            assert ok == admit(sample_version, actor.value, max_staleness)
            assert ok == (lag <= max_staleness), (sample_version, actor.value, max_staleness)
        metrics = gate.metrics()
        admitted = sum(lag <= max_staleness for lag in lags)
        assert (metrics["rl/admitted"], metrics["rl/rejected_stale"]) == (admitted, len(lags) - admitted)
        assert metrics["rl/staleness_max"] == max(lags)
        assert metrics["rl/staleness_mean"] == pytest.approx(sum(lags) / len(lags))
    # the boundary by hand: actor at 5, max_staleness 1
    assert [admit(v, 5, 1) for v in (5, 4, 3, 0)] == [True, True, False, False]
    assert [admit(v, 5, 0) for v in (5, 4)] == [True, False]


def test_staleness_gate_metrics_by_hand() -> None:
    gate = StalenessGate(1)
    assert gate.metrics()["rl/rejected_stale_fraction"] == 0.0  # nothing seen: no division by zero
    for version in (5, 4, 3, 2):
        gate.admit(version, 5)
    assert gate.metrics() == {"rl/admitted": 2.0, "rl/rejected_stale": 2.0, "rl/rejected_stale_fraction": 0.5,
                              "rl/staleness_mean": 1.5, "rl/staleness_max": 3.0}
    gate.reset()
    assert gate.seen == 0 and gate.metrics()["rl/staleness_max"] == 0.0


def test_a_sample_newer_than_the_actor_is_refused_loudly() -> None:
    with pytest.raises(ValueError, match="version 4 reached the actor at version 3"):
        staleness(4, 3)
    with pytest.raises(ValueError, match="max_staleness"):
        admit(1, 1, -1)


def test_samples_check_their_shapes() -> None:
    k, h, a = 3, 5, 4
    sample = ChunkSample(0, 1, 2, 0, {"task": "t"}, np.zeros((k + 1, h, a)), np.zeros((k, h, a)), version=0)
    assert sample.trajectory.dtype == np.float32 and sample.actions.shape == (h, a)
    with pytest.raises(ValueError, match="does not match trajectory"):
        ChunkSample(0, 1, 2, 0, {}, np.zeros((k + 1, h, a)), np.zeros((k + 1, h, a)), version=0)
    with pytest.raises(ValueError, match="ChunkSample.version"):
        ChunkSample(0, 1, 2, 0, {}, np.zeros((k + 1, h, a)), np.zeros((k, h, a)), version=-1)
    with pytest.raises(ValueError, match="finite"):
        EpisodeEnd(0, 0, 0, True, float("nan"), 10, 0)
