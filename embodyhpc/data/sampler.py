"""Step-level sampling across all frames of all episodes: which dataset indices each rank draws, in what order.

Guarantee. For a given (seed, epoch) every rank computes the same permutation of the dataset indices 0..N-1.
Counting from the point where the epoch (re)started, position p of that permutation goes to rank p mod world_size,
so at any moment the ranks draw disjoint samples and, stepping in lockstep, each yields an equal share. The state a
checkpoint saves is only (epoch, number of positions consumed globally); a resumed run, on any world size, deals
the remaining suffix of the same permutation round-robin to its ranks. Across any number of resumes, the samples
an epoch draws are therefore a prefix of one permutation, each position drawn exactly once: nothing repeats and
nothing is skipped, apart from the epoch tail below.

Epoch tail, when the R positions left are not a multiple of world_size W (every rank must draw the same number of
samples, or the ranks' collectives would fall out of step):
- tail="drop" (default): each rank draws R // W; the last R % W < W positions are not drawn this epoch. They are
  different samples each epoch, since the permutation changes.
- tail="wrap": each rank draws ceil(R / W); the missing positions wrap to the start of the permutation, so every
  sample is drawn at least once, with fewer than W extra draws (so no sample more than twice when N >= W).

Assumptions the guarantee rests on:
- every rank builds the sampler with the same num_samples, seed, shuffle (the state checks these on load);
- every rank consumes the same number of samples per step, as DDP/FSDP training does;
- the training loop calls `advance(num_samples_per_rank)` for what the model actually consumed. The sampler cannot
  count this itself: a DataLoader prefetches batches ahead of the model, and counting what the iterator yielded
  would skip the prefetched samples after a resume.

data/gop_order.py's GopOrderedSampler (data.gop_window_batches) keeps this dealing and regroups each rank's share of
windows of micro-batches by video file; its state adds the window grid in force.

The permutation is a keyed Feistel network over the smallest power of four >= N, with cycle walking back into
0..N-1: the position -> index map is computed on demand in vectorised blocks, so memory stays O(1) in N (a
materialised permutation of a 1e9-frame corpus would cost 8 GB per rank) and a resume at any position is free.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import numpy as np
from torch.utils.data import Sampler

from embodyhpc.data.errors import DatasetError

TailPolicy = Literal["drop", "wrap"]
TAIL_POLICIES: tuple[str, ...] = ("drop", "wrap")
STATE_VERSION = 1

# Luby-Rackoff: 4 rounds of a pseudo-random function give a pseudo-random permutation; 6 leave a margin.
_NUM_FEISTEL_ROUNDS = 6
# Positions mapped per vectorised call: big enough to amortise numpy overhead, small enough to stay in cache.
_BLOCK_SIZE = 8192
_MIX_MUL_1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finaliser constants
_MIX_MUL_2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit flips about half the output bits (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX_MUL_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_MUL_2
    return z ^ (z >> np.uint64(31))


def epoch_permutation(positions: np.ndarray, *, num_samples: int, seed: int, epoch: int,
                      shuffle: bool = True) -> np.ndarray:
    """The dataset indices at `positions` (each in 0..num_samples-1) of the permutation for (seed, epoch).

    A pure function of its arguments, identical on every rank and every machine (numpy's SeedSequence and
    fixed-width integer arithmetic only). shuffle=False gives the identity, for evaluation in dataset order.
    """
    positions = np.asarray(positions, dtype=np.int64)
    if not shuffle:
        return positions.copy()
    half_bits = max(1, ((num_samples - 1).bit_length() + 1) // 2)
    half_mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    round_keys = np.random.SeedSequence([seed, epoch]).generate_state(_NUM_FEISTEL_ROUNDS, dtype=np.uint64)

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & half_mask
        for key in round_keys:
            left, right = right, left ^ (_mix64(right ^ key) & half_mask)
        return (left << shift) | right

    # Cycle walking: re-encrypt values that land outside 0..N-1. The cycle through an in-range position always
    # returns to an in-range value, and the domain is < 4N, so on average fewer than 4 passes are needed.
    values = feistel(positions.astype(np.uint64))
    outside = values >= np.uint64(num_samples)
    while outside.any():
        values[outside] = feistel(values[outside])
        outside = values >= np.uint64(num_samples)
    return values.astype(np.int64)


class StepSampler(Sampler[int]):
    """Dataset indices for one rank: its round-robin share of a per-epoch global permutation (see module doc).

    Use it as a DataLoader `sampler=` (or inside a BatchSampler); after each optimizer step call
    `advance(samples_this_rank_consumed)`; save `state_dict()` with the checkpoint (it is the same on every rank)
    and pass it to `load_state_dict()` on resume, whatever the new world size.
    """

    def __init__(self, num_samples: int, *, rank: int, world_size: int, seed: int = 0, shuffle: bool = True,
                 tail: TailPolicy = "drop") -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if tail not in TAIL_POLICIES:
            raise ValueError(f"tail must be one of {', '.join(TAIL_POLICIES)}, got {tail!r}")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.tail = tail
        self.epoch = 0
        self.num_consumed = 0  # positions of this epoch's permutation consumed by all ranks together

    def _num_draws_per_rank(self, num_consumed: int) -> int:
        num_left = max(0, self.num_samples - num_consumed)
        if self.tail == "drop":
            return num_left // self.world_size
        return -(-num_left // self.world_size)

    def __len__(self) -> int:
        """Samples this rank draws from the current state to the end of the epoch (the same on every rank)."""
        return self._num_draws_per_rank(self.num_consumed)

    def __iter__(self) -> Iterator[int]:
        # The start is captured now, not when the generator first runs, so a later advance() (the model
        # catching up with what this iterator already yielded) does not shift this pass.
        return self._iterate(self.epoch, self.num_consumed, self._num_draws_per_rank(self.num_consumed))

    def _iterate(self, epoch: int, start: int, num_draws: int) -> Iterator[int]:
        for positions in self._position_blocks(start, num_draws):
            yield from epoch_permutation(positions, num_samples=self.num_samples, seed=self.seed, epoch=epoch,
                                         shuffle=self.shuffle).tolist()

    def _position_blocks(self, start: int, num_draws: int) -> Iterator[np.ndarray]:
        """This rank's positions of the epoch's permutation, from `start` (positions consumed by all ranks), in
        vectorised blocks."""
        for first_draw in range(0, num_draws, _BLOCK_SIZE):
            draws = np.arange(first_draw, min(first_draw + _BLOCK_SIZE, num_draws), dtype=np.int64)
            yield (start + self.rank + draws * self.world_size) % self.num_samples  # % only bites for "wrap"

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning, unless it is already the current one.

        Keeping the position when the epoch is unchanged lets the usual `for epoch in ...: set_epoch(epoch)` loop
        run after `load_state_dict()` without replaying the part of the epoch done before the resume.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch = epoch
            self.num_consumed = 0

    def advance(self, num_samples_per_rank: int) -> None:
        """Record that every rank's model consumed `num_samples_per_rank` more samples of this epoch."""
        num_left = self._num_draws_per_rank(self.num_consumed)
        if not 0 <= num_samples_per_rank <= num_left:
            raise ValueError(f"advance({num_samples_per_rank}): this rank has {num_left} samples left in epoch "
                             f"{self.epoch}; call set_epoch() for the next epoch")
        self.num_consumed += num_samples_per_rank * self.world_size

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and bools (loads with torch.load(weights_only=True)); identical on every rank."""
        return {"version": STATE_VERSION, "num_samples": self.num_samples, "seed": self.seed,
                "shuffle": self.shuffle, "epoch": self.epoch, "num_consumed": self.num_consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where `state` left off; the world size and rank may differ from the run that saved it."""
        if state.get("version") != STATE_VERSION:
            raise DatasetError(f"sampler state version {state.get('version')!r}, expected {STATE_VERSION}",
                               fix="resume with the embodyhpc version that wrote the checkpoint")
        if state.get("gop_window") is not None:  # data/gop_order.py's sampler reads (and removes) it first
            raise DatasetError("the checkpoint's samples were regrouped by data.gop_window_batches, which this "
                               "run's dataset reader cannot do (it does not say which video file a sample reads)",
                               fix="resume with the dataset format of the checkpointed run, or start a new run")
        for key in ("num_samples", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise DatasetError(
                    f"the checkpoint's sampler has {key}={state[key]!r}, this run has {key}={getattr(self, key)!r}: "
                    "the epoch's order would differ, so resuming could repeat or skip samples",
                    fix=f"resume with the same dataset and {key} as the checkpointed run, or start a new run")
        # num_consumed may pass num_samples by < world_size after a "wrap" tail: that epoch simply has none left.
        if state["epoch"] < 0 or state["num_consumed"] < 0:
            raise DatasetError(f"sampler state out of range: epoch={state['epoch']} "
                               f"num_consumed={state['num_consumed']}")
        self.epoch = state["epoch"]
        self.num_consumed = state["num_consumed"]
