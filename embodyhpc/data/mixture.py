"""A weighted mixture of datasets (data.datasets) as one map-style Dataset, and the sampler that deals it.

Draw scheme. The mixture is an endless stream of global draw positions g = 0, 1, 2, ... (epoch e of the sampler
covers g in [e * L, (e + 1) * L), L = the members' frames added up). Position g is a pure function of (seed, g):
- its member d: a counter-based hash u(seed, g) in [0, 1) (splitmix64's finaliser, as the sampler's Feistel rounds)
  against the cumulative normalised weights, so each draw picks member d with probability w_d / sum(w), independently
  of every other draw;
- its frame in d: position g mod N_d of member d's own Feistel permutation for (seed, d, g // N_d)
  (data/sampler.py epoch_permutation), so the draws of d within each window [k * N_d, (k + 1) * N_d) of positions
  are distinct frames (a member is sampled without replacement per window, with replacement across windows).
Why a hash of the position and not a seeded random stream: nothing has to be replayed to find where a resumed run is,
and what position g holds does not depend on which rank draws it. The stream is dealt by StepSampler unchanged
(shuffle=False: positions in order, round-robin to the ranks), so its guarantees carry over: the same global order
on any world size, and a resume (state: epoch, positions consumed) continues the stream where it stopped.

Items are the member's items plus `dataset_index` (int) and, when the entry names one, `embodiment` (its string);
the collates pick each sample's statistics (MixtureNormalizer) and embodiment by them. data.gop_window_batches is
refused for mixtures (config/data_mixture.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from embodyhpc.data.errors import DatasetError
from embodyhpc.data.sampler import StepSampler, _mix64, epoch_permutation

DATASET_INDEX_KEY = "dataset_index"
EMBODIMENT_KEY = "embodiment"
_CHOICE_SALT = 0x6D697874  # "mixt": the member-choice hash differs from any member permutation's keys
_BLOCK = 8192


def member_choice(positions: np.ndarray, cumulative: np.ndarray, seed: int) -> np.ndarray:
    """The member each global position draws from: u(seed, g) in [0, 1) against `cumulative` (the normalised
    cumulative weights, last = 1)."""
    key = np.random.SeedSequence([seed, _CHOICE_SALT]).generate_state(1, dtype=np.uint64)[0]
    bits = _mix64(_mix64(np.asarray(positions, dtype=np.uint64) ^ key))
    u = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return np.minimum(np.searchsorted(cumulative, u, side="right"), len(cumulative) - 1)


class MixtureDataset(Dataset):
    """Members drawn by weight: index g is the global draw position (see the module doc), len() one epoch of them."""

    def __init__(self, members: Sequence[Dataset], weights: Sequence[float], *, seed: int,
                 embodiments: Sequence[str | None] | None = None, identities: Sequence[str] | None = None) -> None:
        if not members or len(members) != len(weights):
            raise ValueError("need one weight per member dataset, and at least one member")
        self.members = list(members)
        self.sizes = [len(m) for m in self.members]
        empty = next((i for i, n in enumerate(self.sizes) if n < 1), None)
        if empty is not None:
            raise DatasetError(f"data.datasets[{empty}] has no frames", where=str(getattr(members[empty], "root", "")))
        w = np.asarray(weights, dtype=np.float64)
        if not (np.isfinite(w).all() and (w > 0).all()):
            raise ValueError(f"weights must be positive and finite, got {list(weights)}")
        self.weights = tuple(float(x) for x in w)
        self.cumulative = np.cumsum(w / w.sum())
        self.cumulative[-1] = 1.0
        self.seed = seed
        self.embodiments = list(embodiments) if embodiments is not None else [None] * len(self.members)
        self.epoch_length = int(sum(self.sizes))
        self.identities = list(identities) if identities is not None else None  # what each member holds (a digest)

    def __len__(self) -> int:
        return self.epoch_length

    def locate(self, positions: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(member, frame in the member) of each global draw position (int64 arrays)."""
        g = np.asarray(positions, dtype=np.int64)
        members = member_choice(g, self.cumulative, self.seed)
        frames = np.empty_like(g)
        for d, size in enumerate(self.sizes):
            mask = members == d
            if not mask.any():
                continue
            gd = g[mask]
            out = np.empty_like(gd)
            for epoch in np.unique(gd // size):  # a member's epochs: a fresh permutation every N_d positions
                sel = gd // size == epoch
                out[sel] = epoch_permutation(gd[sel] % size, num_samples=size, seed=self.seed * 1_000_003 + d,
                                             epoch=int(epoch))
            frames[mask] = out
        return members.astype(np.int64), frames

    def _tag(self, item: dict[str, Any], member: int) -> dict[str, Any]:
        item[DATASET_INDEX_KEY] = member
        if self.embodiments[member] is not None:
            item[EMBODIMENT_KEY] = self.embodiments[member]
        return item

    def __getitem__(self, g: int) -> dict[str, Any]:
        members, frames = self.locate([int(g)])
        return self._tag(self.members[int(members[0])][int(frames[0])], int(members[0]))

    def __getitems__(self, positions: Sequence[int]) -> list[dict[str, Any]]:
        """A micro-batch: each member's items read together (its own batched decode), in the positions' order."""
        members, frames = self.locate(positions)
        items: list[Any] = [None] * len(members)
        for d in np.unique(members).tolist():
            where = np.flatnonzero(members == d)
            member = self.members[d]
            wanted = frames[where].tolist()
            got = member.__getitems__(wanted) if hasattr(member, "__getitems__") else [member[i] for i in wanted]
            for n, item in zip(where.tolist(), got, strict=True):
                items[n] = self._tag(item, d)
        return items

    # frame options reach every member (data/loader.py configure_frames)
    def set_frame_options(self, **options: Any) -> None:
        for member in self.members:
            configure = getattr(member, "set_frame_options", None)
            if configure is not None:
                configure(**options)

    def first_video_file(self) -> Any:
        return next((f for m in self.members if (f := getattr(m, "first_video_file", lambda: None)()) is not None),
                    None)

    @property
    def tolerance_s(self) -> float:
        return min(float(getattr(m, "tolerance_s", 1e-4)) for m in self.members)

    @property
    def decode_seconds(self) -> float:
        return sum(float(getattr(m, "decode_seconds", 0.0)) for m in self.members)

    def fingerprint(self) -> dict[str, Any]:
        """What must match for a resumed run to continue the same stream: each member's frames and weight, and
        (when known: data/mixture_open.py dataset_identity) a digest of what it holds, not where it is (a staged copy
        of a dataset is the same dataset; another dataset of the same length is not)."""
        body: dict[str, Any] = {"sizes": list(self.sizes), "weights": list(self.weights)}
        if self.identities is not None:
            body["datasets"] = list(self.identities)
        return body


class MixtureSampler(StepSampler):
    """StepSampler's dealing of the stream of global draw positions: epoch e yields e * L + p for its positions p in
    order (shuffle=False: the randomness is in what each position holds). State: StepSampler's plus the mixture's
    fingerprint, checked on resume (other weights or datasets would change what every position holds)."""

    def __init__(self, dataset: MixtureDataset, *, rank: int, world_size: int, seed: int = 0,
                 tail: str = "drop") -> None:
        super().__init__(len(dataset), rank=rank, world_size=world_size, seed=seed, shuffle=False,
                         tail=tail)  # type: ignore[arg-type]
        self.mixture = dataset.fingerprint()

    def _iterate(self, epoch: int, start: int, num_draws: int) -> Iterator[int]:
        base = epoch * self.num_samples
        for positions in self._position_blocks(start, num_draws):
            yield from (positions + base).tolist()

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "mixture": dict(self.mixture)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        differs = mixture_difference(state.pop("mixture", None), self.mixture)
        if differs is not None:
            raise DatasetError(f"the checkpoint's data mixture differs from this run's: {differs}; every draw "
                               "position would hold another sample",
                               fix="resume with the checkpointed run's data.datasets (roots and weights), "
                                   "or start a new run")
        super().load_state_dict(state)


def mixture_difference(saved: Any, now: dict[str, Any]) -> str | None:
    """The first difference between a checkpoint's mixture fingerprint and this run's, in words (None: the same). A
    checkpoint without dataset digests (written before they were kept) is compared on sizes and weights."""
    if not isinstance(saved, dict):
        return f"the checkpoint holds no mixture ({saved!r})"
    if len(saved.get("sizes", ())) != len(now["sizes"]):
        return f"{len(saved.get('sizes', ()))} datasets in the checkpoint, {len(now['sizes'])} now"
    names = {"sizes": "frame count", "weights": "weight", "datasets": "content digest"}
    for key, what in names.items():
        if key not in saved and key == "datasets":
            continue
        for i, (old, new) in enumerate(zip(saved.get(key) or (), now.get(key) or (), strict=False)):
            if old != new:
                if key == "datasets":
                    old, new = str(old)[:12], str(new)[:12]
                return f"data.datasets[{i}]'s {what} was {old}, is {new}"
        if key in saved and key not in now:
            return "the checkpoint names each dataset's content, this run does not"
    return None


def mixture_order(dataset: MixtureDataset, sampler: StepSampler) -> Iterator[tuple[int, int]]:
    """(member, frame) of each draw `sampler` yields from where it stands (for tests and inspection)."""
    positions = list(sampler)
    for block in range(0, len(positions), _BLOCK):
        members, frames = dataset.locate(positions[block:block + _BLOCK])
        yield from zip(members.tolist(), frames.tolist(), strict=True)


class MixtureNormalizer:
    """One StateNormalizer per member dataset; a sample is normalised with its own dataset's (`for_item`). Called
    directly (inference, what evaluation and export read) it is the evaluation entry's."""

    def __init__(self, normalizers: Sequence[Any], eval_index: int = 0) -> None:
        if not 0 <= eval_index < len(normalizers):
            raise ValueError(f"eval_index {eval_index} out of range for {len(normalizers)} normalisers")
        self.normalizers = tuple(normalizers)
        self.eval_index = eval_index

    @property
    def eval(self) -> Any:
        return self.normalizers[self.eval_index]

    def for_item(self, item: Any) -> Any:
        index = item.get(DATASET_INDEX_KEY) if hasattr(item, "get") else None
        if index is None:
            return self.eval
        return self.normalizers[int(index)]

    def __call__(self, state: Any) -> Any:
        return self.eval(state)

    def to_dict(self) -> dict[str, Any]:
        return {"eval_index": self.eval_index, "datasets": [n.to_dict() for n in self.normalizers]}


def normalizer_for(normalizer: Any, item: Any) -> Any:
    """The normaliser of `item`'s dataset: a MixtureNormalizer's member for a mixture's item, else `normalizer`."""
    select = getattr(normalizer, "for_item", None)
    return select(item) if select is not None else normalizer
