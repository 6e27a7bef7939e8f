"""What a DataLoader worker sends back when reading or collating fails: a record, never a raised exception.

Why not let the exception travel the usual way: torch re-raises a worker's exception in the training process by
calling its class with the worker's traceback text as the only argument, which loses the error's fields (key, fix,
file) and spreads it over dozens of lines, and it reaches the training loop as whatever type that call produced.
So the dataset and the collate are wrapped here: a failure becomes a `WorkerFailure` (one line, the worker, what it
was doing) that travels back as the batch, and embodyhpc/data/loader.py turns it into one DataWorkerError.

A bad sample (the dataset raised while reading it: a corrupt video frame, an unreadable chunk) is a `WorkerFailure`
too with `data.on_bad_sample: error` (the default). With `skip`, it is dropped from its micro-batch, counted in
`SkipCounter` (shared with the training process, which logs it as data_skipped_samples) and named on the rank's log;
a micro-batch whose samples were all bad comes back as `SkippedBatch`. A collate failure is never skipped: it comes
from the recipe or the model (an action horizon the chunk does not have, a prompt budget too small), not the data.

A micro-batch is read with the dataset's `__getitems__` where it has one (one decode call per video file per
batch); if that raises, every sample is read again on its own, so the failure is named and skipped per sample.
`LoaderCounters` (shared like SkipCounter) adds up what the workers did: samples, seconds decoding, seconds busy
reading and collating; the loop logs them as data_decode_ms_per_sample and data_loader_samples_per_s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from embodyhpc.config.schema import ON_BAD_SAMPLE
from embodyhpc.data.errors import SampleError
from embodyhpc.errors import UserError

LOGGED_SKIPS_PER_WORKER = 20
"""Skipped samples each worker names on the log; later ones are counted only (a broken file can hold thousands)."""
MAX_ERROR_CHARS = 500


def one_line(exc: BaseException) -> str:
    """`Type: message` on one line (a UserError's own one-line form), cut to MAX_ERROR_CHARS."""
    text = exc.one_line() if isinstance(exc, UserError) else " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 3] + "..."


def _worker_id() -> int | None:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return None if info is None else info.id


@dataclass(frozen=True)
class WorkerFailure:
    """A worker's failure, sent back in place of a batch (picklable; pin_memory passes it through unchanged)."""

    error: str
    """The exception on one line: `SampleError: /data/videos/.../file-000.mp4: episode 3, frame 61: ...`."""
    doing: str
    """What the worker was doing: `reading sample 61`, `collating a micro-batch`."""
    worker: int | None
    """The worker's id on its rank; None when the training process loads data itself (data.num_workers=0)."""


@dataclass(frozen=True)
class SkippedBatch:
    """Every sample of a micro-batch was bad and skipped (data.on_bad_sample: skip)."""

    num_samples: int


@dataclass(frozen=True)
class BadSample:
    index: int
    error: str
    skippable: bool


class SkipCounter:
    """Samples skipped by every worker of one rank: a shared integer the workers add to and the rank reads."""

    def __init__(self) -> None:
        import multiprocessing

        self._value = multiprocessing.Value("q", 0)
        self._logged = 0  # per process: each worker has its own copy after the fork

    def add(self, n: int, errors: Sequence[str]) -> None:
        with self._value.get_lock():
            self._value.value += n
        worker = _worker_id()
        who = "the training process" if worker is None else f"data worker {worker}"
        for error in errors:
            self._logged += 1
            if self._logged <= LOGGED_SKIPS_PER_WORKER:
                print(f"warning: {who} skipped a bad sample (data.on_bad_sample=skip): {error}", file=sys.stderr,
                      flush=True)
            if self._logged == LOGGED_SKIPS_PER_WORKER:
                print(f"warning: {who} names no further skipped samples; the metric data_skipped_samples counts "
                      "them", file=sys.stderr, flush=True)

    @property
    def value(self) -> int:
        return int(self._value.value)


class LoaderCounters:
    """What the workers of one rank did, in shared integers: samples delivered, nanoseconds decoding (the dataset's
    `decode_seconds`) and busy (reading and collating). `take()` gives the totals since the last take."""

    def __init__(self) -> None:
        import multiprocessing

        self._values = multiprocessing.Array("q", 3)  # samples, decode ns, busy ns
        self._taken = (0, 0, 0)

    def add(self, samples: int, decode_s: float, busy_s: float) -> None:
        with self._values.get_lock():
            self._values[0] += int(samples)
            self._values[1] += int(decode_s * 1e9)
            self._values[2] += int(busy_s * 1e9)

    def take(self) -> tuple[int, float, float]:
        """(samples, decode seconds, busy seconds) since the previous take (in this process)."""
        with self._values.get_lock():
            now = tuple(self._values[:])
        samples, decode_ns, busy_ns = (a - b for a, b in zip(now, self._taken, strict=True))
        self._taken = now
        return samples, decode_ns / 1e9, busy_ns / 1e9


class _Fetched(list):
    """A micro-batch's items as GuardedDataset read them, with the seconds it took (for the collate's counters)."""

    decode_s = 0.0
    fetch_s = 0.0


class GuardedDataset:
    """The training dataset with reading failures turned into records (the collate below decides what they become).

    A map-style dataset (len, getitem, getitems): the DataLoader's sampler draws indices of it as of the wrapped one.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:  # noqa: BLE001 - every failure becomes a record the training process reports
            # a bad sample is the data's fault (its reader says SampleError, or any non-UserError such as a decoder's);
            # another UserError (a ConfigError raised while reading) is the recipe's, and skipping would hide it
            skippable = isinstance(exc, SampleError) or not isinstance(exc, UserError)
            return BadSample(int(index), one_line(exc), skippable)

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The micro-batch's items: the dataset's own __getitems__ (batched decoding) when it has one; if that fails,
        or it has none, one sample at a time, each failure a record of its own."""
        started = time.perf_counter()
        decode_before = getattr(self.dataset, "decode_seconds", 0.0)
        fetched = _Fetched()
        batched = getattr(self.dataset, "__getitems__", None)
        try:
            fetched.extend(batched(list(indices)) if batched is not None else [self[i] for i in indices])
        except Exception:  # noqa: BLE001 - read again per sample below: the failure is then named per sample
            fetched.extend(self[i] for i in indices)
        fetched.decode_s = getattr(self.dataset, "decode_seconds", 0.0) - decode_before
        fetched.fetch_s = time.perf_counter() - started
        return fetched


class GuardedCollate:
    """The collate with every failure turned into a WorkerFailure (or, for bad samples under `skip`, a smaller
    micro-batch and a count)."""

    def __init__(self, collate: Callable[[list[Any]], Any] | None, on_bad_sample: str, skipped: SkipCounter,
                 counters: LoaderCounters | None = None) -> None:
        if on_bad_sample not in ON_BAD_SAMPLE:
            raise ValueError(f"on_bad_sample must be one of {ON_BAD_SAMPLE}, got {on_bad_sample!r}")
        if collate is None:
            from torch.utils.data import default_collate

            collate = default_collate
        self.collate = collate
        self.on_bad_sample = on_bad_sample
        self.skipped = skipped
        self.counters = counters

    def __call__(self, items: list[Any]) -> Any:
        started = time.perf_counter()
        batch = self._collate(items)
        if self.counters is not None and not isinstance(batch, WorkerFailure | SkippedBatch):
            num = sum(not isinstance(item, BadSample) for item in items)
            self.counters.add(num, getattr(items, "decode_s", 0.0),
                              getattr(items, "fetch_s", 0.0) + time.perf_counter() - started)
        return batch

    def _collate(self, items: list[Any]) -> Any:
        bad = [item for item in items if isinstance(item, BadSample)]
        if bad:
            fatal = [b for b in bad if not b.skippable or self.on_bad_sample == "error"]
            if fatal:
                return WorkerFailure(fatal[0].error, f"reading sample {fatal[0].index}", _worker_id())
            self.skipped.add(len(bad), [f"sample {b.index}: {b.error}" for b in bad])
            items = [item for item in items if not isinstance(item, BadSample)]
            if not items:
                return SkippedBatch(len(bad))
        try:
            return self.collate(items)
        except Exception as exc:  # noqa: BLE001 - the recipe's or the model's failure: reported, never skipped
            return WorkerFailure(one_line(exc), "collating a micro-batch", _worker_id())
