"""data.gop_window_batches: windows of W micro-batches regrouped so that samples sharing decoded video frames land
in one micro-batch.

Why. A DataLoader worker decodes every frame a micro-batch needs from one video file in one call (data/lerobot.py
`__getitems__`). Frames of random samples rarely share a GOP, so each costs its own seek and its GOP's frames before
it; samples of one file and nearby frames in the same micro-batch share them.

What changes. StepSampler (data/sampler.py) deals the positions ("slots" here) of the epoch's permutation round-robin
to the ranks. A window is W x micro-batch x world-size consecutive slots, counted from the grid's base (the epoch's
start): W micro-batches of every rank. Inside a window each rank's slots (its share) read its own share's positions
in another order: the dataset indices they hold are sorted by (video file, frame) (the reader's `frame_locations`),
cut into micro-batches of neighbours, and the micro-batches shuffled, seeded by (seed, epoch, base, window, share),
so that one file's batch does not always come first. Hence:
- every window, every rank's share of it, and so every epoch, draw the same samples as with W = 0; windows follow
  the permutation's order; W = 0 is StepSampler's order exactly;
- the order is a pure function of (seed, epoch, grid, window): a resume continues it exactly;
- a resume with another world size, micro-batch or W finishes the window it stopped in with the checkpoint's grid
  (the state's "gop_window"), then starts the new grid at the resumed run's first micro-batch boundary after that
  window's end: nothing repeats, nothing is skipped (if that window is the epoch's last, the fewer than world-size
  x micro-batch samples the epoch's tail leaves out may be others than with W = 0);
- in the epoch's last window only each share's whole micro-batches are regrouped: the incomplete micro-batch a rank
  leaves out (drop_last) holds the samples it holds with W = 0.
What does change is the make-up of a micro-batch: neighbours of one episode, less varied than random samples.

Cost: one sort of W x micro-batch indices per rank and window, in the training process (the sampler runs there).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from embodyhpc.data.errors import DatasetError
from embodyhpc.data.sampler import StepSampler, TailPolicy, epoch_permutation

Locate = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]
"""Dataset indices -> (video file number, frame number inside that file), both int64 arrays of the same length."""

_CACHE_SIZE = 256  # regrouped shares kept (a rank reads its own share of each window; a resize reads many)
_SEED_TAG = 0x60F  # keeps these streams apart from the permutation's SeedSequence([seed, epoch])


@dataclass(frozen=True)
class WindowGrid:
    """Windows of `window_batches` micro-batches of `micro_batch` samples on `world_size` ranks, from slot `base`."""

    base: int
    world_size: int
    micro_batch: int
    window_batches: int

    @property
    def size(self) -> int:
        return self.window_batches * self.micro_batch * self.world_size

    def window_start(self, slot: int) -> int:
        return self.base + (slot - self.base) // self.size * self.size

    def same_shape(self, other: WindowGrid) -> bool:
        return (self.world_size, self.micro_batch, self.window_batches) == (
            other.world_size, other.micro_batch, other.window_batches)

    @classmethod
    def from_state(cls, value: Any) -> WindowGrid:
        keys = ("base", "world_size", "micro_batch", "window_batches")
        if not isinstance(value, dict) or sorted(value) != sorted(keys) or not all(
                isinstance(value[k], int) and not isinstance(value[k], bool) for k in keys):
            raise DatasetError(f"sampler state's gop_window is not {{{', '.join(keys)}}} (integers): {value!r}",
                               fix="resume from a checkpoint written by embodyhpc, or start a new run")
        grid = cls(**value)
        if grid.base < 0 or min(grid.world_size, grid.micro_batch, grid.window_batches) < 1:
            raise DatasetError(f"sampler state's gop_window out of range: {value!r}",
                               fix="resume from a checkpoint written by embodyhpc, or start a new run")
        return grid


class GopOrderedSampler(StepSampler):
    """StepSampler whose windows of `window_batches` micro-batches are regrouped by video file and frame (module
    doc); window_batches=0 draws StepSampler's order. Used like StepSampler; its state adds the grid in force."""

    def __init__(self, num_samples: int, *, rank: int, world_size: int, micro_batch: int, window_batches: int,
                 locate: Locate, seed: int = 0, shuffle: bool = True, tail: TailPolicy = "drop") -> None:
        super().__init__(num_samples, rank=rank, world_size=world_size, seed=seed, shuffle=shuffle, tail=tail)
        if micro_batch < 1 or window_batches < 0:
            raise ValueError(f"need micro_batch >= 1 and window_batches >= 0, got {micro_batch}, {window_batches}")
        self.micro_batch = micro_batch
        self.window_batches = window_batches
        self.locate = locate
        self._grid = self._new_grid(0)
        self._carry: tuple[WindowGrid, int, int] | None = None  # an older grid's window [start, end) to finish
        self._shares: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()

    def _new_grid(self, base: int) -> WindowGrid | None:
        if self.window_batches == 0:
            return None
        return WindowGrid(base, self.world_size, self.micro_batch, self.window_batches)

    # -- order ----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        # grid and carry are captured with the start (StepSampler.__iter__): a later load or set_epoch does not
        # change a pass already handed out
        return self._ordered(self.epoch, self.num_consumed, self._num_draws_per_rank(self.num_consumed),
                             self._grid, self._carry)

    def _ordered(self, epoch: int, start: int, num_draws: int, grid: WindowGrid | None,
                 carry: tuple[WindowGrid, int, int] | None) -> Iterator[int]:
        for slots in self._position_blocks(start, num_draws):
            positions = self.positions_of(slots, epoch=epoch, grid=grid, carry=carry)
            yield from epoch_permutation(positions, num_samples=self.num_samples, seed=self.seed, epoch=epoch,
                                         shuffle=self.shuffle).tolist()

    def positions_of(self, slots: np.ndarray, *, epoch: int, grid: WindowGrid | None,
                     carry: tuple[WindowGrid, int, int] | None = None) -> np.ndarray:
        """The permutation positions the dealt `slots` read: a bijection of 0..num_samples-1 onto itself."""
        slots = np.asarray(slots, dtype=np.int64)
        positions = slots.copy()
        done = np.zeros(len(slots), dtype=bool)
        if carry is not None:
            old, start, end = carry
            done = (slots >= start) & (slots < end)
            positions[done] = self._regrouped(slots[done], old, epoch)
        if grid is not None:
            mine = ~done & (slots >= grid.base)
            positions[mine] = self._regrouped(slots[mine], grid, epoch)
        return positions  # slots before every grid (only a "wrap" tail's) keep their position

    def _regrouped(self, slots: np.ndarray, grid: WindowGrid, epoch: int) -> np.ndarray:
        positions = slots.copy()
        window = (slots - grid.base) // grid.size
        offset = slots - (grid.base + window * grid.size)
        share, row = offset % grid.world_size, offset // grid.world_size
        for w, s in sorted(set(zip(window.tolist(), share.tolist(), strict=True))):
            order = self._share_order(grid, epoch, w, s)
            pick = (window == w) & (share == s) & (row < len(order))
            first = grid.base + w * grid.size + s
            positions[pick] = first + grid.world_size * order[row[pick]]
        return positions

    def _share_order(self, grid: WindowGrid, epoch: int, window: int, share: int) -> np.ndarray:
        """Row r of this share of the window reads row order[r] (rows past the end keep their own)."""
        key = (grid, epoch, window, share)
        if key in self._shares:
            self._shares.move_to_end(key)
            return self._shares[key]
        first = grid.base + window * grid.size
        # rows every share holds inside the epoch (StepSampler's "drop" tail), cut to whole micro-batches
        rows = min(grid.size, max(0, self.num_samples - first)) // grid.world_size
        rows -= rows % grid.micro_batch
        if rows < 2 * grid.micro_batch:  # one micro-batch (or none): nothing to regroup
            order = np.arange(0, dtype=np.int64)
        else:
            positions = first + share + grid.world_size * np.arange(rows, dtype=np.int64)
            indices = epoch_permutation(positions, num_samples=self.num_samples, seed=self.seed, epoch=epoch,
                                        shuffle=self.shuffle)
            files, frames = (np.asarray(a, dtype=np.int64) for a in self.locate(indices))
            if files.shape != indices.shape or frames.shape != indices.shape:
                raise DatasetError(f"the dataset's frame_locations gave {files.shape} files and {frames.shape} "
                                   f"frames for {indices.shape} indices")
            batches = np.lexsort((indices, frames, files)).reshape(-1, grid.micro_batch)
            rng = np.random.default_rng([self.seed, epoch, grid.base, window, share, _SEED_TAG])
            order = batches[rng.permutation(len(batches))].reshape(-1)
        self._shares[key] = order
        if len(self._shares) > _CACHE_SIZE:
            self._shares.popitem(last=False)
        return order

    # -- state ----------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._grid, self._carry = self._new_grid(0), None
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """StepSampler's state, plus "gop_window": the grid of the window num_consumed is in (when there is one)."""
        state = super().state_dict()
        grid = self._grid
        if self._carry is not None and self.num_consumed < self._carry[2]:
            grid = self._carry[0]
        if grid is not None:
            state["gop_window"] = asdict(grid)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where `state` left off (any world size, micro-batch or window: module doc)."""
        saved = state.get("gop_window")
        super().load_state_dict({k: v for k, v in state.items() if k != "gop_window"})
        old = WindowGrid.from_state(saved) if saved is not None else None
        here = self._new_grid(0)
        self._carry, self._shares = None, OrderedDict()
        consumed = self.num_consumed
        if old is not None and here is not None and old.same_shape(here):
            self._grid = old
            return
        base = consumed
        if old is not None and consumed < self.num_samples:
            if consumed < old.base:
                raise DatasetError(f"sampler state's gop_window starts at {old.base}, after the {consumed} "
                                   "positions consumed", fix="resume from a checkpoint written by embodyhpc")
            start = old.window_start(consumed)
            if start != consumed:  # stopped inside a window: finish it as it was regrouped
                end = min(start + old.size, self.num_samples)
                self._carry = (old, start, end)
                # the new grid starts at this run's first micro-batch boundary after it (slots between keep their
                # positions), so its windows' rows are this run's micro-batches and its tail is StepSampler's
                step = self.world_size * self.micro_batch
                base = consumed + -(-(end - consumed) // step) * step
        self._grid = self._new_grid(base)
