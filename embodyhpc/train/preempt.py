"""Stop at the same step on every rank when Slurm announces the end of the job (time limit or preemption).

    with StopSignal() as stop:                 # every rank, in its main thread
        for step in ...:
            ...                                # one optimizer step
            if stop.agreed(group):             # every rank, at every step boundary
                save(step, blocking=True)      # collective: every rank takes part
                break

Why not submitit's own handler: submitit installs a SIGUSR2 handler in every task that, on global rank 0 only,
calls the task's `checkpoint()` and requeues the job, and on the other ranks returns. A sharded (FSDP/DCP) save is
a collective, so it cannot run on rank 0 alone, and it cannot run inside a signal handler that interrupts the
loop at an arbitrary point either (possibly in the middle of another collective). So, while our training task
runs, `StopSignal` replaces the handlers of SIGUSR2 (the signal `#SBATCH --signal=USR2@N` sends to every task
before the time limit) and SIGTERM with one that only records the signal. As a context manager it puts the
previous handlers back at the end of the block; the training task instead keeps it installed until its process
exits, since submitit's handler, back after the task returned, would requeue a job that has finished.

How every rank learns of it: Slurm signals every task, but not at the same instant, and a signal sent to one
task (`kill`, a partial `scancel`) reaches only that one. So at each step boundary every rank contributes what it
has received to one 1-element all_reduce(MAX) on a CPU (gloo) group: after it, all ranks hold the same answer
and break at the same step. Every rank runs the reduction at every step, whether or not it has seen a signal, so
it can never wait for a rank that skipped it.

What happens next is the launcher's decision (launch/train.py): the loop saves (blocking) and returns, then rank
0 asks Slurm for one requeue and every rank leaves with `Requeued` (a SystemExit, so submitit writes no result
for the attempt, as with its own requeue), or the retry limit is reached and the job fails saying why.
SIGUSR2 outranks SIGTERM when ranks disagree: SIGTERM alone means Slurm is ending the job itself (`scancel`,
preemption that cancels or requeues on its own), so the job saves and stops without requeueing.

Importing this module does not import torch (the launcher imports it where the CLI may too).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any

from embodyhpc.config.schema import COLLECTIVE_TIMEOUT_S
from embodyhpc.errors import REQUEUE_EXIT_CODE, STOPPED_EXIT_CODE

log = logging.getLogger(__name__)

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGUSR2)
"""In increasing precedence: the agreed signal is the highest-ranked one any rank received."""


class Stopped(SystemExit):
    """Raised on every rank when an attempt ends at a stop signal and Slurm decides what the job becomes.

    A SystemExit, as submitit's own requeue path exits: submitit's runner catches only Exception, so it writes no
    result file for this attempt (the attempt that finishes the job writes the job's result). The default code is
    a SIGTERM death's (after SIGTERM, Slurm cancels or requeues the job itself).
    """

    def __init__(self, message: str, code: int = STOPPED_EXIT_CODE) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Requeued(Stopped):
    """Raised on every rank once the job has been requeued (or, under submitit's local executor, is to be
    restarted: REQUEUE_EXIT_CODE asks it to)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, REQUEUE_EXIT_CODE)


class StopSignal:
    """Records SIGUSR2 / SIGTERM while installed; `agreed()` turns the records of all ranks into one decision.

    Use it as a context manager in the main thread (Python delivers signals there). Outside the main thread it
    installs nothing and only reports what `request()` recorded.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    # ---- installing ----
    def install(self) -> StopSignal:
        """Replace the handlers of `signals` with the recording one (the previous ones are kept for `restore`)."""
        if threading.current_thread() is not threading.main_thread():
            log.warning("StopSignal installed outside the main thread: no signal handlers installed")
            return self
        for sig in self.signals:
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        return self

    def restore(self) -> None:
        """Put the handlers back that were there before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> StopSignal:
        return self.install()

    def __exit__(self, *exc_info: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a record: a signal handler runs between two bytecodes of whatever the rank was doing (possibly in
        # the middle of a collective), so all the work happens at the next step boundary instead.
        self.request(signal.Signals(signum))

    def request(self, sig: signal.Signals) -> None:
        """Record `sig` as if it had been delivered (the highest-ranked one received is kept)."""
        if sig not in self.signals:
            raise ValueError(f"{sig.name} is not one of {', '.join(s.name for s in self.signals)}")
        if self._received is None or self._rank(sig) > self._rank(self._received):
            self._received = sig

    # ---- deciding ----
    @property
    def received(self) -> signal.Signals | None:
        """What this rank received (not agreed with the others)."""
        return self._received

    def agreed(self, group: Any = None) -> str | None:
        """Every rank, at the same point: the name of the stop signal if any rank has received one, else None.

        One all_reduce(MAX) of one int64 on `group`, which must accept CPU tensors (gloo; see `cpu_group`).
        Without an initialised process group it answers for this process alone.
        """
        import torch
        import torch.distributed as dist

        code = 0 if self._received is None else self._rank(self._received) + 1
        if dist.is_available() and dist.is_initialized():
            value = torch.tensor([code], dtype=torch.int64)
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
            code = int(value.item())
        return None if code == 0 else self.signals[code - 1].name

    def _rank(self, sig: signal.Signals) -> int:
        return self.signals.index(sig)


_side_groups: dict[int, tuple[Any, Any]] = {}
"""id(default group) -> (that group, its gloo side group); the group is held so that its id is not reused."""


def cpu_group(timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Any:
    """A process group for CPU collectives (`StopSignal.agreed`, the data-failure agreement of train/stream.py, the
    launcher's hostname gather): the default one when it is gloo, else one gloo group of every rank, created on the
    first call and shared by later ones.

    With NCCL, a CPU flag cannot travel on the default group, and a GPU flag would make every step wait for the
    GPU. One side group per default group: each gloo group holds a connection to every other rank, so one per
    caller would multiply them. Collective on its first call: every rank calls it at the same point. The side group
    waits `timeout_s` in a collective, as the default group does (torch would give a new group 30 minutes).
    """
    from datetime import timedelta

    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    world = dist.group.WORLD
    if id(world) not in _side_groups:
        _side_groups[id(world)] = (world, dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
    return _side_groups[id(world)][1]
