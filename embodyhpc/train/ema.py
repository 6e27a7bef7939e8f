"""The exponential moving average of the trainable weights (`train.ema_decay`), kept as the parameters are kept.

    ema = ParameterEMA(model, decay=0.99)    # after parallelize/materialize; a copy of the current weights
    ...
    optimizer.step()
    ema.update()                              # ema = d * ema + (1 - d) * weights, after every optimizer step

What it holds: one fp32 tensor per trainable parameter (frozen ones never change: their average is themselves),
named by the parameter's state-dict name (the name `get_state_dict` gives it: wrappers' prefixes such as activation
checkpointing's removed), so a checkpoint's `ema.<name>` entries stand beside its `model.<name>` ones and an export
can put one in place of the other (checkpoint/export.py).

Sharding: under FSDP2 a parameter is a DTensor holding this rank's shard; its average is a DTensor with the same mesh
and placements and a local tensor of the same local shape, so each rank holds 4 bytes per parameter of its own shard
and never a full copy; DCP saves and reshards it like the parameters (a checkpoint saved on N ranks resumes on M).
The update works on the local shards only: no collective, no gather.

Precision: the average is fp32 whatever the parameters are (FSDP2 keeps fp32 parameters under bf16 mixed precision;
a lower-precision parameter is cast up before it is averaged), and the update is one multiply and one add per
tensor (`_foreach_mul_`, `_foreach_add_`), in this order: ema * d first, then + (1 - d) * weights.

Why after the optimizer step: the average is of the weights the optimizer produced (openpi's train_step averages
the new parameters, scripts/train.py); an update before the step would average the previous step's weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from embodyhpc.errors import ConfigError

_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")
"""What activation checkpointing (checkpoint_wrapper) and torch.compile's wrapper module add to parameter names and
torch's state-dict helpers take out again (torch.distributed.checkpoint.state_dict)."""


def state_dict_name(name: str) -> str:
    """A parameter's name as the model's state dict (and so a checkpoint's `model.` entries) spells it."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the same storage: in-place changes reach the DTensor), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ParameterEMA:
    """The fp32 moving average of `model`'s trainable parameters (module docstring)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:  # NaN fails this too
            raise ValueError(f"EMA decay must lie strictly between 0 and 1, got {decay!r}")
        self.decay = decay
        self._params: list[torch.Tensor] = []
        self._averages: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, param in model.named_parameters():
                if not param.requires_grad:
                    continue
                key = state_dict_name(name)
                if key in self._averages:
                    raise ValueError(f"two parameters are both named {key!r} in the state dict")
                self._params.append(param)
                # a DTensor's .to() keeps its mesh and placements: this rank's shard, cast and copied
                self._averages[key] = param.detach().to(torch.float32, copy=True)

    @property
    def num_parameters(self) -> int:
        """Parameters averaged (global counts, summed over the tensors)."""
        return sum(average.numel() for average in self._averages.values())

    def local_bytes(self) -> int:
        """Bytes this rank holds for the average (its shards only)."""
        return sum(_local(a).numel() * _local(a).element_size() for a in self._averages.values())

    @torch.no_grad()
    def update(self) -> None:
        """ema = decay * ema + (1 - decay) * weights, for every averaged parameter (this rank's shards)."""
        averages = [_local(a) for a in self._averages.values()]
        weights = [_local(p.detach()) for p in self._params]
        weights = [w if w.dtype == torch.float32 else w.to(torch.float32) for w in weights]
        torch._foreach_mul_(averages, self.decay)
        torch._foreach_add_(averages, weights, alpha=1.0 - self.decay)

    @torch.no_grad()
    def reset(self, note: str | None = None) -> None:
        """The average := the current weights (a fresh run after its initial weights are loaded, or a resume from a
        checkpoint saved without an average: `note` says why, printed)."""
        if note:
            print(f"{note}: the moving average of the weights starts from them", flush=True)
        for average, param in zip(self._averages.values(), self._params, strict=True):
            _local(average).copy_(_local(param.detach()))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """{state-dict name: the average}: the live tensors (DCP's save stages copies of them; DCP's load fills them in
        place)."""
        return self._averages


def build_ema(model: nn.Module, decay: float | None, weights_kind: str | None) -> ParameterEMA | None:
    """The run's moving average (train.ema_decay; None when null), after refusing eval.weights_kind=ema without one:
    the export at the end of training would fail on it after the whole run."""
    if decay is None:
        if weights_kind == "ema":
            raise ConfigError("asks to evaluate the moving average of the weights, and train.ema_decay is null",
                              key="eval.weights_kind", related=("train.ema_decay",),
                              fix="set train.ema_decay=0.99 (openpi's default), or eval.weights_kind=raw")
        return None
    return ParameterEMA(model, decay)
