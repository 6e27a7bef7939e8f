"""Weights from the actor to the rollout workers: only the trainable parameters, one flat buffer per dtype, through
torch.distributed broadcasts in a group [actor rank 0, rollout workers] (NCCL on GPUs, gloo here).

    actor (every rank)   state = trainable_state(model)        a collective under FSDP2 (DTensor.full_tensor)
    actor rank 0         WeightSender(group, src=0).send(state, version)
    rollout worker       receiver = WeightReceiver(model, group, src=0); receiver.start()
                         ... at every chunk boundary: receiver.swap_if_ready() -> new version or None

The group is either one of the job's world (`sync_group`: new_group over [actor rank 0, rollout ranks], every
rank of the world calls it) or a group of its own beside the actor's world (`standalone_group`: a TCPStore on actor
rank 0's host, whose port embodyhpc.rl.endpoints publishes), so that the actor's FSDP collectives stay among the
actor ranks. `src` is the sender's rank within the group. The ProcessGroup's own broadcast is called, which both
kinds accept.

One sync on the wire: a header (int64: version, layout hash, payload bytes), then one buffer per dtype (dtypes in
name order; within one, the parameters in the model's order, flattened). The layout hash covers every trainable
parameter's name (wrappers' prefixes such as activation checkpointing's and torch.compile's removed), dtype and
shape: a rollout model that does not train the same parameters (a different freeze, a different size) is refused
with one line, not filled with misplaced weights. Version -1 is the sender's goodbye.

The receiver receives on a background thread into a staging copy (so the envs never wait for the transfer), holds
it until the rollout loop calls `swap_if_ready()` at a chunk boundary (no chunk is ever produced by half-old,
half-new weights), and only then receives the next version. Every receive is bounded: `timeout_s` (the roles pass
rl.peer_timeout_s) on each collective; a sender that dies breaks the connection and the receiver raises at once; a
sender that stays silent past the bound is dead too: `swap_if_ready` / `wait_ready` raise PeerTimeout naming it.
The actor must therefore sync at least every `timeout_s` (each version is a sync): the roles pass a bound longer
than the actor's slowest optimizer step.
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from embodyhpc.errors import RunFailure
from embodyhpc.rl.transport import PeerTimeout

GOODBYE = -1
_HEADER = 3  # version, layout hash, payload bytes


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: tensor} of the parameters that train (requires_grad), detached, whole: a DTensor (FSDP2) is gathered
    with full_tensor(), a collective every actor rank must call in the same order. Frozen parameters never appear."""
    # a DTensor exists only once its module is imported: no import (a second) where none can be
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    state = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        tensor = param.detach()
        state[name] = tensor.full_tensor() if dtensor is not None and isinstance(tensor, dtensor) else tensor
    return state


_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """A parameter's name without the prefixes wrappers add (activation checkpointing, torch.compile, FSDP1): the
    actor's wrapped model and a rollout worker's plain one name a parameter alike."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _layout(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict[torch.dtype, list[tuple[str, torch.Tensor]]],
                                                                   int]:
    """Tensors grouped by dtype (dtypes by name, tensors in their given order) and the layout's hash (int64)."""
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in tensors:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    ordered = dict(sorted(groups.items(), key=lambda item: str(item[0])))
    digest = hashlib.sha256()
    for dtype, items in ordered.items():
        for name, tensor in items:
            digest.update(f"{clean_name(name)}|{dtype}|{tuple(tensor.shape)};".encode())
    return ordered, int.from_bytes(digest.digest()[:8], "little", signed=True)


def _broadcast(tensor: torch.Tensor, src: int, group, timeout_s: float, peer: str) -> None:
    """One broadcast from group rank `src` in `group` (a ProcessGroup), bounded by `timeout_s`."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    work = group.broadcast([tensor], options)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # gloo: "Operation timed out", "Connection closed by peer" (the sender died)
        if "timed out" in str(exc).lower():
            raise PeerTimeout(peer, timeout_s, "sent no weights") from None
        raise RunFailure(f"{peer} broke off the weight sync: {' '.join(str(exc).split())[:200]}") from None


def sync_group(actor_src: int, rollout_ranks: Iterable[int], timeout_s: float):
    """The weight-sync group [actor_src, *rollout_ranks] of the job's world (actor_src is rank 0 in it when it is the
    lowest); every rank of the world must call this (new_group is a collective), also those outside the group."""
    return dist.new_group(sorted({actor_src, *rollout_ranks}), timeout=timedelta(seconds=timeout_s))


def standalone_group(host: str, port: int, rank: int, size: int, timeout_s: float, backend: str = "gloo"):
    """A group of `size` processes of its own (rank 0: actor rank 0, which hosts the TCPStore at host:port; 1..:
    the rollout workers), beside whatever world each process is in. Bounded by `timeout_s` (the store's wait for
    every member, and each collective's default)."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore("rl-weights", dist.TCPStore(host, port, size, rank == 0, timeout=timeout))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"weight sync backend {backend!r}: gloo or nccl")


class WeightSender:
    """Actor rank `src`'s end. `send(state, version)` returns the payload bytes it broadcast (`bytes_sent`: all)."""

    def __init__(self, group, src: int = 0, *, timeout_s: float = 300.0, device: torch.device | str | None = None
                 ) -> None:
        self.group = group
        self.src = src
        self.timeout_s = timeout_s
        self.device = device  # where the buffers go for the group (cpu for gloo); None: where the weights are
        self.bytes_sent = 0

    def _broadcast(self, tensor: torch.Tensor) -> None:
        _broadcast(tensor, self.src, self.group, self.timeout_s, "the rollout workers")

    def send(self, state: dict[str, torch.Tensor], version: int) -> int:
        if version < 0:
            raise ValueError(f"policy version {version} < 0")
        groups, layout_hash = _layout(state.items())
        flats = [torch.cat([t.reshape(-1) for _, t in items]) for items in groups.values()]
        if self.device is not None:
            flats = [flat.to(self.device) for flat in flats]
        payload = sum(flat.numel() * flat.element_size() for flat in flats)
        device = flats[0].device if flats else torch.device(self.device or "cpu")
        self._broadcast(torch.tensor([version, layout_hash, payload], dtype=torch.int64, device=device))
        for flat in flats:
            self._broadcast(flat)
        self.bytes_sent += payload
        return payload

    def close(self) -> None:
        """Tell the receivers no more versions come (they stop without waiting for their timeout)."""
        self._broadcast(torch.tensor([GOODBYE, 0, 0], dtype=torch.int64, device=self.device or "cpu"))


class WeightReceiver:
    """A rollout worker's end: `start()` receives in the background into a staging copy; `swap_if_ready()` (at a
    chunk boundary) copies a staged version into the model and returns it, None when none is staged.
    `names`: the parameters the actor trains (default: this model's requires_grad parameters)."""

    def __init__(self, model: nn.Module, group, src: int = 0, *, names: Iterable[str] | None = None,
                 timeout_s: float = 300.0, peer: str = "actor rank 0", device: torch.device | str | None = None
                 ) -> None:
        wanted = {clean_name(name) for name in names} if names is not None else None
        params = [(name, p) for name, p in model.named_parameters()
                  if (p.requires_grad if wanted is None else clean_name(name) in wanted)]
        if wanted is not None and len(params) != len(wanted):
            missing = sorted(wanted - {clean_name(name) for name, _ in params})
            raise ValueError(f"the rollout model has no parameter {missing[0]!r} of the {len(wanted)} to sync")
        self._groups, self.layout_hash = _layout(params)
        self._staging = {dtype: torch.empty(sum(p.numel() for _, p in items), dtype=dtype,
                                            device=device if device is not None else items[0][1].device)
                         for dtype, items in self._groups.items()}
        self.payload_bytes = sum(b.numel() * b.element_size() for b in self._staging.values())
        self._device = next(iter(self._staging.values())).device if self._staging else torch.device(device or "cpu")
        self.group, self.src, self.timeout_s, self.peer = group, src, timeout_s, peer
        self._staged: int | None = None  # a version in staging, not yet swapped in
        self._swapped = threading.Event()
        self._swapped.set()
        self._ready = threading.Condition()
        self._error: BaseException | None = None
        self._finished = False
        self._thread: threading.Thread | None = None
        self.bytes_received = 0

    def _broadcast(self, tensor: torch.Tensor) -> None:
        _broadcast(tensor, self.src, self.group, self.timeout_s, self.peer)

    def receive_one(self) -> int:
        """Receive one version into staging (blocking, bounded); its number, or GOODBYE."""
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self._device)
        self._broadcast(header)
        version, layout_hash, payload = (int(v) for v in header.tolist())
        if version == GOODBYE:
            return GOODBYE
        if layout_hash != self.layout_hash or payload != self.payload_bytes:
            raise RunFailure(f"weights from {self.peer} do not fit this rollout worker's trainable parameters "
                             f"({payload} bytes, layout {layout_hash:x}; expected {self.payload_bytes} bytes, layout "
                             f"{self.layout_hash:x}): the actor and rollout models must be built and frozen alike")
        for buffer in self._staging.values():
            self._broadcast(buffer)
        self.bytes_received += payload
        return version

    def _loop(self) -> None:
        try:
            while True:
                # staging is free only once the last version is in the model: a rollout loop that takes no
                # version for timeout_s is stuck (it swaps at every chunk boundary), and the worker ends saying so
                if not self._swapped.wait(timeout=self.timeout_s):
                    raise RunFailure(f"this rollout worker did not swap in version {self._staged} for "
                                     f"{self.timeout_s:.0f} s (it swaps at every chunk boundary): its loop is stuck")
                version = self.receive_one()
                with self._ready:
                    if version == GOODBYE:
                        self._finished = True
                    else:
                        self._swapped.clear()
                        self._staged = version
                    self._ready.notify_all()
                if version == GOODBYE:
                    return
        except BaseException as exc:  # handed to the rollout loop: swap_if_ready raises it
            with self._ready:
                self._error = exc
                self._ready.notify_all()

    def start(self) -> WeightReceiver:
        self._thread = threading.Thread(target=self._loop, name="weight-receiver", daemon=True)
        self._thread.start()
        return self

    @property
    def finished(self) -> bool:
        """The sender said goodbye and every version it sent was swapped in."""
        return self._finished and self._staged is None

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Block until a version is staged (the synchronous pipeline, before its next round); False after a
        goodbye; PeerTimeout after `timeout_s` (default: the receiver's)."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        with self._ready:
            while self._staged is None and self._error is None and not self._finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(self.peer, bound, "sent no weights")
                self._ready.wait(left)
            self._raise()
            return self._staged is not None

    def swap_if_ready(self) -> int | None:
        """At a chunk boundary: copy a staged version into the model, return its number; None when none is staged.
        Raises what the receiving thread met (the sender died, timed out, sent another layout)."""
        with self._ready:
            self._raise()
            version = self._staged
            if version is None:
                return None
            with torch.no_grad():
                for dtype, items in self._groups.items():
                    offset, flat = 0, self._staging[dtype]
                    for _, param in items:
                        param.copy_(flat[offset:offset + param.numel()].view_as(param))
                        offset += param.numel()
            self._staged = None
            self._swapped.set()
            return version

    def drain(self, timeout_s: float | None = None) -> None:
        """The rollout loop is done: take part in what the actor still broadcasts (a last version, dropped unused,
        then its goodbye) until the receiving thread ends, within `timeout_s` (default: the receiver's). A process
        must not exit while that thread is inside a collective: the group torn down under it aborts the process
        ("terminate called without an active exception"), which fails the whole Slurm step."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        while self._thread is not None and self._thread.is_alive():
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(self.peer, bound, "sent no goodbye after the last version")
            with self._ready:
                if self._staged is not None:  # nothing will run on it: free staging for the next broadcast
                    self._staged = None
                    self._swapped.set()
                self._ready.wait(min(left, 0.5))
        self._raise()

    def join(self, timeout_s: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(self.timeout_s if timeout_s is None else timeout_s)
