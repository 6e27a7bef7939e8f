"""What a checkpoint holds besides RNG streams: model + optimizer (+ the weights' moving average when the run keeps
one, train.ema_decay: under EMA_KEY, named as the model's entries) (sharded, through DCP) and the trainer state.

Model and optimizer go through torch.distributed.checkpoint.state_dict: it names every entry by the module's
fully-qualified parameter name whatever wraps it (FSDP2, activation checkpointing, compile), and hands DCP the
local shards (DTensors) with their global layout, so a checkpoint saved on N ranks loads on M ranks, or into a
plain module.

The trainer state (step, sampler position, scheduler, counters) is identical on every rank. It is written once, by
rank 0, as JSON: readable by people and by tools without torch, and free of pickle. Anything in it must therefore
be JSON data (the StepSampler's and torch LR schedulers' state dicts are).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from embodyhpc.atomic import write_json_atomic
from embodyhpc.checkpoint.layout import TRAINER_JSON

TRAINER_STATE_VERSION = 1
MODEL_KEY, OPTIM_KEY = "model", "optim"  # top-level keys of the DCP state; export reads MODEL_KEY
EMA_KEY = "ema"
"""The moving average of the weights (train/ema.py), when the run keeps one: {state-dict name: fp32 DTensor shard},
named as MODEL_KEY's entries; an export may read it in their place (export.py)."""


@dataclass
class TrainerState:
    """The rank-independent part of where training stands."""

    step: int
    """Optimizer steps done: resume runs step + 1 next."""
    sampler: dict[str, Any] | None = None
    """The data sampler's state_dict() (identical on every rank), so resume continues the same data order."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Anything else the loop needs back (LR scheduler state, token counters): JSON data only."""


def model_and_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                          ema: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """The DCP state to save, or to load into: each rank's local shards, nothing is gathered.

    For an optimizer that has not stepped yet, get_state_dict creates its state (a zero-lr step), so a fresh
    optimizer has every entry DCP needs to load into. `ema`: the weights' moving average (ParameterEMA.state_dict(),
    its live tensors, which DCP's load fills in place), under EMA_KEY; None leaves the key out.
    """
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {MODEL_KEY: model_state, OPTIM_KEY: optim_state}
    if ema is not None:
        unknown = sorted(set(ema) - set(model_state))
        if unknown:  # an export could not put them in place of the model's entries
            raise KeyError(f"the EMA names {len(unknown)} tensors the model's state dict does not (e.g. {unknown[0]})")
        state[EMA_KEY] = ema
    return state


def has_ema(saved_keys: set[str] | dict[str, Any]) -> bool:
    """Whether a checkpoint (its flattened state_dict_metadata keys) holds a moving average of the weights."""
    return any(key.startswith(EMA_KEY + ".") for key in saved_keys)


def match_optimizer_request(state: dict[str, Any], saved_keys: set[str]) -> None:
    """Make the optimizer part of a state about to be loaded ask for exactly the parameters the checkpoint has.

    AdamW creates a parameter's state at its first gradient; a parameter that never got one (pi0.5's last-layer
    VLM query projection: nothing reads the prefix queries of the last layer) has no state in the checkpoint,
    while a fresh optimizer has state for every parameter (get_state_dict initialises it), and DCP fails on keys
    it cannot find. Those entries are dropped here, so the loaded optimizer leaves the parameters stateless, as
    the saved run did. The reverse (the checkpoint has state the live optimizer lacks: loading into an optimizer
    that has stepped) is refused rather than silently skipped. `saved_keys` are the checkpoint's flattened keys.
    """
    prefix = f"{OPTIM_KEY}.state."
    per_param = state[OPTIM_KEY].get("state", {})
    for name in list(per_param):
        keys = {f"{prefix}{name}.{entry}" for entry in per_param[name]}
        present = keys & saved_keys
        if not present:
            del per_param[name]
        elif present != keys:
            raise KeyError(f"the checkpoint has only part of the optimizer state of {name}: "
                           f"missing {sorted(keys - present)}")
    saved_params = {key[len(prefix):].rsplit(".", 1)[0] for key in saved_keys if key.startswith(prefix)}
    unrequested = saved_params - per_param.keys()
    if unrequested:
        raise KeyError(f"the checkpoint has optimizer state for {len(unrequested)} parameters the live optimizer "
                       f"has none for (e.g. {sorted(unrequested)[0]}): load into a freshly built optimizer")


EXTRA_STATE = "_extra_state"
"""The last name of a module's extra state in a state dict (torch.nn.Module's _EXTRA_STATE_KEY_SUFFIX)."""


def is_module_extra_state(key: str) -> bool:
    return key.rpartition(".")[2] == EXTRA_STATE


def match_extra_state_request(state: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """Make the model's extra-state entries of a state about to be loaded ask for what the checkpoint holds.

    transformer-engine keeps a te.Linear's FP8 scaling state (recipe, delayed scaling's scales and amax history) as
    its `_extra_state`: an empty uint8 tensor until the layer has run in FP8, a pickled payload of some hundred bytes
    after. A freshly built model therefore asks for 0 bytes where the checkpoint saved hundreds, and DCP refuses the
    size difference on every rank. Each such request is replaced by a buffer of the saved size and dtype (DCP fills
    it; the module's own set_extra_state reads it when the model state is applied). An extra state the checkpoint
    does not have (it was saved by a model without such layers) is taken out of the request and returned, for the
    caller to put back after loading: the module then keeps its own. `saved`: the checkpoint's
    state_dict_metadata (flattened keys)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model_state = state[MODEL_KEY]
    absent: dict[str, Any] = {}
    for name in [name for name in model_state if is_module_extra_state(name)]:
        meta = saved.get(f"{MODEL_KEY}.{name}")
        if meta is None:
            absent[name] = model_state.pop(name)
        elif isinstance(meta, TensorStorageMetadata) and isinstance(model_state[name], torch.Tensor):
            model_state[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    return absent


def apply_model_and_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Copy what dcp.load filled into `state` into the live model and optimizer.

    The model loads strictly. The optimizer's own strict check is off because parameters without saved state
    are legitimate (see match_optimizer_request, which has already checked the request against the checkpoint).
    """
    set_model_state_dict(model, state[MODEL_KEY])
    set_optimizer_state_dict(model, optimizer, state[OPTIM_KEY], options=StateDictOptions(strict=False))


def write_trainer_state(folder: Path, state: TrainerState) -> None:
    payload = {"version": TRAINER_STATE_VERSION, **asdict(state)}
    try:
        json.dumps(payload, allow_nan=True)
    except TypeError as exc:
        raise TypeError(f"trainer state must be JSON data (sampler, extra): {exc}") from exc
    write_json_atomic(folder / TRAINER_JSON, payload)


def read_trainer_state(folder: Path) -> TrainerState:
    payload = json.loads((folder / TRAINER_JSON).read_text())
    if payload.get("version") != TRAINER_STATE_VERSION:
        raise ValueError(f"{folder / TRAINER_JSON}: trainer state version {payload.get('version')!r}, "
                         f"expected {TRAINER_STATE_VERSION}")
    return TrainerState(step=payload["step"], sampler=payload.get("sampler"), extra=payload.get("extra") or {})
