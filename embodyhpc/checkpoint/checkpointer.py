"""Checkpointer: sharded DCP saves (async or not) into `step-N` folders, retention, resume, export.

Every method is called by every rank at the same point of the loop (they run collectives on the checkpoint group).

A save, in order (see layout.py for the folder):
1. wait for the previous save (one save in flight at most: bounded memory, and the group has one user);
2. rank 0 removes an unmarked folder of the same step (a crash leftover that DCP would otherwise mix into);
3. every rank writes its RNG file, rank 0 trainer.json; DCP stages model + optimizer (+ the weights' moving
   average, train/ema.py, when the run keeps one) to CPU memory;
4. async: DCP writes in a background thread and the loop goes on -- the stall is steps 1-3 only;
5. when every rank's write is done (agreed by a reduction on the checkpoint group), rank 0 writes the marker,
   points `latest` at the folder and applies retention; a second agreement makes every rank see the result.
Step 5 runs in a thread of our own that waits on DCP's future, so the marker appears as soon as the data is safe,
not at the next save. A rank that dies mid-save leaves the folder unmarked: resume skips it, retention deletes it.

Async saves use DCP's thread executor (the default): it needs no `if __name__ == "__main__"` guard in the launching
script, which the process executor does, and the loop's stall is the staging copy either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from embodyhpc.checkpoint import layout, rng
from embodyhpc.checkpoint.errors import CheckpointError, last_line
from embodyhpc.checkpoint.export import export_consolidated
from embodyhpc.checkpoint.group import CheckpointGroup
from embodyhpc.checkpoint.state import (
    MODEL_KEY,
    TrainerState,
    apply_model_and_optim_state,
    has_ema,
    match_extra_state_request,
    match_optimizer_request,
    model_and_optim_state,
    read_trainer_state,
    write_trainer_state,
)
from embodyhpc.config.schema import CheckpointConfig

log = logging.getLogger(__name__)
MARKER_VERSION = 1


class WeightsAverage(Protocol):
    """What the checkpointer needs of the weights' moving average (train/ema.py ParameterEMA)."""

    decay: float

    def state_dict(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class SaveResult:
    step: int
    folder: Path
    stall_s: float
    """Seconds the training loop was blocked by this call (waiting for the previous save included)."""
    is_async: bool
    skipped: bool = False
    """True when the step already had a complete folder (a save right after resuming from it)."""


@dataclass(frozen=True)
class LoadResult:
    step: int
    folder: Path
    trainer: TrainerState
    saved_world_size: int
    rng_restored: bool
    """False when the world size changed: every rank was reseeded from (seed, step, rank) instead."""
    ema_restored: bool = False
    """True when an `ema` was given and the checkpoint held one, which was loaded into it; False leaves the `ema`
    given as it was (a checkpoint saved without a moving average: the caller starts one from the loaded weights)."""


class Checkpointer:
    def __init__(self, root: str | Path, cfg: CheckpointConfig, *, seed: int = 0, device: torch.device | str = "cpu",
                 collective_timeout_s: float | None = None,
                 on_complete: Callable[[int, Path], None] | None = None) -> None:
        """`root` is the run's checkpoints/ folder; `seed` reseeds RNGs on a resume at another world size.
        `device` is where the model and optimizer live: on a GPU async saves stage into pinned memory (staging_options).
        `on_complete(step, folder)` runs on rank 0 after each save is marked complete, outside any collective: for
        async saves in the finisher thread, not the training thread. Its failures are logged, never raised.

        Collective: creates the dedicated gloo group, so every rank constructs its Checkpointer at the same point.
        """
        self.root = Path(root)
        self.cfg = cfg
        self.seed = seed
        self.on_complete = on_complete
        self.group = CheckpointGroup(collective_timeout_s)
        if self.group.is_rank0:
            self.root.mkdir(parents=True, exist_ok=True)
        self.group.barrier()
        # One worker: the finisher of save k must complete before that of save k+1 starts (and it does, since
        # save() waits), and it must be the only user of the group while a save is in flight.
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-finish")
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        # One stager for the whole run: it keeps the CPU staging buffers between saves (keyed by the storage of
        # each parameter and optimizer tensor) instead of allocating and faulting in the state's size every time.
        # Reuse is safe only because a save waits for the one before it.
        self._stager = DefaultStager(staging_options(device))

    # ---- saving ----
    def due(self, step: int) -> bool:
        """Whether `step` is a periodic save step (the final and preemption saves are the loop's call)."""
        return step > 0 and step % self.cfg.every_steps == 0

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,
             sampler_state: dict[str, Any] | None = None, extra: dict[str, Any] | None = None,
             blocking: bool | None = None, ema: WeightsAverage | None = None) -> SaveResult:
        """Save `step`; async unless `blocking` (default: not cfg.async_save). Use blocking=True for the last save
        of a job (preemption, end of training): the job must not exit before the data is safe. `ema`: the weights'
        moving average, saved beside them (its decay goes into the marker)."""
        start = time.perf_counter()
        is_async = self.cfg.async_save if blocking is None else not blocking
        self.wait()
        folder = layout.step_dir(self.root, step)
        if self.group.broadcast_int(int(self.group.is_rank0 and layout.is_complete(folder))):
            return SaveResult(step, folder, time.perf_counter() - start, is_async, skipped=True)
        trainer = TrainerState(step=step, sampler=sampler_state, extra=extra or {})
        # on_rank0 ends in a broadcast: no rank writes into the folder before rank 0 has (re)created it.
        self.group.on_rank0(f"preparing {folder.name}", lambda: _prepare_folder(folder, trainer))
        rng_error = _try(lambda: rng.save_rng_file(layout.rng_file(folder, self.group.rank), rng.capture_rng_state()))
        if not self.group.all_true(rng_error is None):  # before DCP's collectives, which would wait for this rank
            raise CheckpointError(f"writing RNG state for {folder.name} failed: {rng_error or 'on another rank'}")
        state = model_and_optim_state(model, optimizer, None if ema is None else ema.state_dict())
        ema_decay = None if ema is None else ema.decay
        if is_async:
            # Staging (the CPU copy) happens inside async_save, before it returns: training may change the
            # parameters (and their average) right after without touching what is written.
            future = dcp.async_save(state, checkpoint_id=folder, async_stager=self._stager, **self._dcp_group())
            stall_s = time.perf_counter() - start
            self._pending = self._finisher.submit(self._finish, future, step, start, stall_s, True, ema_decay)
            self._pending_step = step
        else:
            dcp.save(state, checkpoint_id=folder, **self._dcp_group())
            stall_s = time.perf_counter() - start
            self._finish(None, step, start, stall_s, False, ema_decay)
            stall_s = time.perf_counter() - start
        return SaveResult(step, folder, stall_s, is_async)

    def _dcp_group(self) -> dict[str, Any]:
        """DCP's process-group arguments: ours, or an explicit single process (one rank, no process group)."""
        if self.group.distributed:
            return {"process_group": self.group.group}
        return {"no_dist": True}

    def _finish(self, future: Future | None, step: int, start: float, stall_s: float, is_async: bool,
                ema_decay: float | None = None) -> None:
        """Every rank, after its own DCP write: agree all ranks wrote, then rank 0 marks, points and prunes."""
        error: BaseException | None = None
        if future is not None:
            try:
                future.result()
            except Exception as exc:  # still join the reduction below, or the other ranks would hang there
                error = exc
        if not self.group.all_true(error is None):
            detail = f": {error}" if error is not None else " on another rank (see its log)"
            raise CheckpointError(f"saving step {step} failed{detail}; the folder stays unmarked") from error
        folder = layout.step_dir(self.root, step)
        info = {"version": MARKER_VERSION, "step": step, "world_size": self.group.world_size, "async": is_async,
                "saved_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "wall_s": round(time.perf_counter() - start, 4), "stall_s": round(stall_s, 4),
                "torch": torch.__version__, "ema_decay": ema_decay}
        self.group.on_rank0(f"completing {folder.name}", lambda: self._complete(folder, step, info))
        if self.on_complete is not None and self.group.is_rank0:
            try:
                self.on_complete(step, folder)
            except Exception:  # e.g. an evaluation that could not be submitted: never the checkpoint's failure
                log.exception("after completing %s: on_complete failed", folder.name)

    def _complete(self, folder: Path, step: int, info: dict[str, Any]) -> None:
        layout.write_marker(folder, info)
        layout.write_latest(self.root, step)
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Rank 0, with no save in flight (called at the end of one): keep the newest keep_latest_k, and any folder
        an evaluation has pinned until it has exported it (a later save's retention removes it then)."""
        for old in layout.plan_retention(layout.list_steps(self.root), self.cfg.keep_latest_k):
            folder = layout.step_dir(self.root, old)
            if not layout.pinned_by(folder):
                layout.remove_folder(folder)
        layout.remove_retiring_leftovers(self.root)

    def wait(self) -> float:
        """Block until the save in flight (if any) is complete and marked; returns the seconds blocked.
        Raises CheckpointError on every rank if it failed on any."""
        if self._pending is None:
            return 0.0
        start = time.perf_counter()
        pending, self._pending, self._pending_step = self._pending, None, None
        pending.result()
        return time.perf_counter() - start

    @property
    def in_flight_step(self) -> int | None:
        """The step of the async save not yet waited for (it may have finished in the background meanwhile)."""
        return self._pending_step

    # ---- resuming ----
    def newest_complete_step(self) -> int | None:
        """Rank 0's reading of the folder, shared so that every rank loads the same step."""
        local = layout.list_steps(self.root).newest_complete if self.group.is_rank0 else None
        step = self.group.broadcast_int(-1 if local is None else local)
        return None if step < 0 else step

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
                    ema: WeightsAverage | None = None) -> LoadResult | None:
        """Load the newest complete checkpoint into `model` and `optimizer` (and `ema`, when it holds a moving
        average: LoadResult.ema_restored); None when there is none: a fresh run.

        Call it after the model is sharded and before the data iterators start drawing: it restores RNG streams.
        """
        self.wait()
        step = self.newest_complete_step()
        return None if step is None else self.load(step, model, optimizer, ema=ema)

    def load(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, *,
             ema: WeightsAverage | None = None) -> LoadResult:
        """Load step-N (which must be complete) into `model` and `optimizer`, restore trainer state and RNG; into
        `ema` too (its tensors, in place, resharded like the parameters) when the checkpoint holds a moving average.
        A checkpoint's average that no `ema` asks for is left on disk."""
        self.wait()
        folder = layout.step_dir(self.root, step)
        # Agreed, so that a rank whose view of the filesystem lags raises together with the others instead of
        # leaving them inside DCP's collectives.
        if not self.group.all_true(layout.is_complete(folder)):
            raise CheckpointError(f"{folder} has no {layout.MARKER} marker (on some rank): it was never completely "
                                  "written")
        wrong = _try(lambda: layout.checkpoint_step(folder))  # the step its record holds, not only its name says
        if not self.group.all_true(wrong is None):
            raise CheckpointError(f"{folder} cannot be resumed from: "
                                  f"{getattr(wrong, 'message', wrong) or 'its record disagrees on another rank'}")
        saved_world_size = int(layout.read_marker(folder)["world_size"])
        saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        ema_restored = ema is not None and has_ema(saved)  # the same on every rank: the same metadata
        state = model_and_optim_state(model, optimizer, ema.state_dict() if ema_restored else None)
        match_optimizer_request(state, set(saved))  # the same decision on every rank: same names, same metadata
        kept = match_extra_state_request(state, saved)
        try:
            dcp.load(state, checkpoint_id=folder, **self._dcp_group())
        except CheckpointException as exc:  # a BaseException, which `except Exception` handlers would let through;
            # DCP gathers every rank's failure, so every rank raises here and none waits in a collective
            raise CheckpointError(f"{folder} cannot be loaded into this model: {last_line(exc)}") from None
        state[MODEL_KEY].update(kept)
        apply_model_and_optim_state(model, optimizer, state)

        rng_restored = saved_world_size == self.group.world_size
        loaded: list[TrainerState] = []
        error = _try(lambda: loaded.append(self._restore_local(folder, step, rng_restored)))
        if not self.group.all_true(error is None):  # the loop's next collective would otherwise wait forever
            raise CheckpointError(f"restoring trainer/RNG state from {folder} failed: {error or 'on another rank'}")
        if not rng_restored and self.group.is_rank0:
            log.warning("%s was saved on %d ranks, resuming on %d: RNG streams are reseeded from "
                        "(seed=%d, step=%d, rank), not continued", folder.name, saved_world_size,
                        self.group.world_size, self.seed, step)
        return LoadResult(step, folder, loaded[0], saved_world_size, rng_restored, ema_restored)

    def _restore_local(self, folder: Path, step: int, rng_restored: bool) -> TrainerState:
        trainer = read_trainer_state(folder)
        if rng_restored:
            note = rng.restore_rng_state(rng.load_rng_file(layout.rng_file(folder, self.group.rank)))
            if note is not None:  # each rank's own log: the hardware may differ between ranks
                log.warning("%s, rank %d: %s", folder.name, self.group.rank, note)
        else:
            rng.reseed(rng.derived_seed(self.seed, step, self.group.rank))
        return trainer

    # ---- export ----
    def export(self, out_dir: str | Path, *, config_yaml: str, step: int | None = None,
               side_files: Mapping[str, str | Path | None] | None = None,
               weights_kind: str | None = None) -> Path | None:
        """Consolidated weights (one safetensors file) + the resolved config (+ `side_files`, hashed into
        export.json: export.export_consolidated), from a complete checkpoint. `weights_kind`: ema, raw, or None
        (ema when the checkpoint has a moving average): eval.weights_kind, export.choose_weights.

        Every rank calls it; rank 0 reads the DCP files by itself (no collectives) while the others wait, so
        that no rank tears the job down before the file exists. Returns the weights path on rank 0.
        """
        self.wait()
        chosen = step if step is not None else self.newest_complete_step()
        if chosen is None:
            raise CheckpointError(f"nothing to export: no complete checkpoint under {self.root}")
        folder = layout.step_dir(self.root, chosen)
        return self.group.on_rank0(f"exporting {folder.name}",
                                   lambda: export_consolidated(folder, Path(out_dir), config_yaml=config_yaml,
                                                               side_files=side_files, weights_kind=weights_kind))

    def close(self) -> None:
        """Finish the save in flight (a job must not exit under it), then stop the finisher thread."""
        try:
            self.wait()
        finally:
            self._finisher.shutdown(wait=True)
            self._stager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def staging_options(device: torch.device | str) -> StagingOptions:
    """How async saves copy the state to CPU memory (DCP's DefaultStager, torch 2.13), by where the state lives.

    On a GPU: pinned buffers (registered once, reused by every save) and non-blocking device-to-host copies that
    queue back to back, then one synchronize before the stager returns, so the write never reads a half-copied
    buffer. On the CPU: plain copies (pinning needs CUDA, and a CPU run on a GPU node gains nothing from it).
    Staging stays synchronous (the loop's stall) and private to this process (thread executor: no shared memory).
    """
    on_gpu = torch.device(device).type == "cuda"
    return StagingOptions(use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False,
                          use_non_blocking_copy=on_gpu)


def _prepare_folder(folder: Path, trainer: TrainerState) -> None:
    """Rank 0: an empty folder for the step (removing an unmarked crash leftover of it), then trainer.json."""
    if folder.exists():
        log.warning("removing %s: an unmarked folder of the step about to be saved (crash leftover)", folder)
        layout.remove_folder(folder)
    folder.mkdir(parents=True)
    write_trainer_state(folder, trainer)


def _try(fn: Callable[[], object]) -> Exception | None:
    try:
        fn()
    except Exception as exc:  # the caller agrees on it with the other ranks
        return exc
    return None
