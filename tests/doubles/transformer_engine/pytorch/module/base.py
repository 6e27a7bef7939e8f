"""TransformerEngineBaseModule as in transformer_engine/pytorch/module/base.py (v2.9-v2.18): parameters carry
their init function (register_parameter(..., init_fn=...)), and reset_parameters(defer_init=False) first moves
any parameter still on the meta device to **cuda** (`torch.empty_like(param, device="cuda")`) and initialises it
there. On this CPU-only machine that line raises, as the real code would on a node without CUDA: the double keeps
the line, so a build that reaches it fails here too."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tensor: nn.init.normal_(tensor, mean=0.0, std=sigma)


def init_method_constant(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda tensor: nn.init.constant_(tensor, value)


def get_default_init_method() -> Callable[[torch.Tensor], torch.Tensor]:
    return init_method_normal(0.023)  # utils.get_default_init_method


@dataclass
class _ParameterInitMeta:
    init_fn: Callable | None = None
    get_rng_state_tracker: Callable | None = None
    fp8_meta_index: int | None = None

    def __post_init__(self) -> None:
        if self.init_fn is None:
            self.init_fn = get_default_init_method()


class TransformerEngineBaseModule(nn.Module):
    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = name
        self.param_init_meta: dict[str, _ParameterInitMeta] = {}
        self.fp8 = False

    def register_parameter(self, name, param, **kwargs):
        super().register_parameter(name, param)
        # FSDP2 re-registers parameters as DTensors without the kwargs: keep the first metadata
        if hasattr(self, "param_init_meta") and name not in self.param_init_meta:
            self.param_init_meta[name] = _ParameterInitMeta(**kwargs)

    def reset_parameters(self, defer_init: bool | None = False) -> None:
        if defer_init:
            return
        for name, param in self.named_parameters(recurse=False):
            if param.device == torch.device("meta"):
                param = torch.empty_like(param, device="cuda")  # as in TE: materialise on a real cuda device
            with torch.no_grad():
                self.param_init_meta[name].init_fn(param)
            setattr(self, name, nn.Parameter(param))
