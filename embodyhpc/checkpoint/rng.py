"""Random-number-generator state of one rank: captured with a checkpoint, restored on resume.

Exact resume needs every stream that the loop draws from after the checkpoint: torch's CPU generator (noise and
flow-matching times), the current CUDA device's generator, Python's `random` and NumPy's legacy global generator
(augmentations). The state is per rank, since each rank draws different noise, so each rank writes its own small
file (a few KB) next to the DCP files.

When the world size changes on resume, rank r of the new run is not the continuation of any old rank (its data
shard differs too), so exact continuation is impossible. The ranks are then reseeded from (seed, step, rank):
reproducible, and no two ranks share a stream, which copying old ranks' states onto new ranks would cause.

Files hold only tensors, ints, floats and lists, so they load with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for the trainer; its stream is captured when it is there
    np = None  # type: ignore[assignment]

RNG_STATE_VERSION = 1


def capture_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"version": RNG_STATE_VERSION, "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one GPU per rank
    version, internal, gauss_next = random.getstate()
    state["python"] = {"version": version, "internal": list(internal), "gauss_next": gauss_next}
    if np is not None:
        kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    return state


def restore_rng_state(state: dict[str, Any]) -> str | None:
    """Restore every stream the state holds; the CUDA one into the current device (the rank's GPU, made current
    before loading). Returns a one-line note when the CUDA side cannot continue exactly (a GPU checkpoint resumed
    without a GPU, or a CPU checkpoint resumed on one), else None: the other streams are restored either way, and
    a resume on other hardware is legitimate (debugging a GPU run on a CPU), so it is said rather than refused."""
    if state.get("version") != RNG_STATE_VERSION:
        raise ValueError(f"RNG state version {state.get('version')!r}, expected {RNG_STATE_VERSION}")
    torch.set_rng_state(state["torch"])
    note = None
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
        else:
            note = "the checkpoint holds a CUDA RNG stream but this rank has no GPU: it is not restored"
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        note = ("the checkpoint holds no CUDA RNG stream (saved without a GPU) but this rank draws on one: it keeps "
                "its seeded state, so GPU noise differs from an uninterrupted run")
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if np is not None and "numpy" in state:
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    return note


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit seed for (seed, step, rank): hashed, so neighbouring ranks or steps get unrelated streams."""
    digest = hashlib.sha256(f"embodyhpc-rng/{seed}/{step}/{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def reseed(seed: int) -> None:
    """Seed every stream capture_rng_state covers (torch.manual_seed also seeds all CUDA devices)."""
    torch.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)


def save_rng_file(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)


def load_rng_file(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)
