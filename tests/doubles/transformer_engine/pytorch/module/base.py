"""TransformerEngineBaseModule as in transformer_engine/pytorch/module/base.py (v2.9-v2.18), as strict as the real one
on the points embodyhpc's code paths meet:

- CUDA: the constructor asserts `torch.cuda.is_available()` ("TransformerEngine needs CUDA.", v2.9 base.py:643;
  a RuntimeError from v2.18), and every forward outside a recompute asserts `inp.is_cuda` (prepare_forward, v2.9
  base.py:1083). A CPU test that stands for a GPU node says so explicitly: `EMBODYHPC_TE_DOUBLE_CUDA=1` in the
  environment (inherited by the test's rank and job processes; `device_present()`), and CPU tensors then stand for
  CUDA ones. Without it the double refuses as TE refuses on a node without a GPU.
- parameters carry their init function (register_parameter(..., init_fn=...)), and reset_parameters(
  defer_init=False) first moves any parameter still on the meta device to **cuda** (`torch.empty_like(param,
  device="cuda")`) and initialises it there. On this CPU-only machine that line raises, as the real code would on a
  node without CUDA: the double keeps the line, so a build that reaches it fails here too.
- `_extra_state` (get_extra_state / set_extra_state, v2.9 base.py:842-959): an empty uint8 tensor until the module
  has run a forward in FP8 (fp8_meta["fp8_checkpoint"], set by every forward from the autocast state, so a later
  forward outside autocast empties it again), then a pickled uint8 tensor of some hundred bytes holding the recipe,
  the delayed-scaling scales and amax histories, and the fp8_meta scalars. Its size therefore differs between a
  freshly built module and one that trained. transformer-engine 2.9-2.17 write the payload for every recipe, 2.18
  only for delayed scaling (`is_stateless_recipe`); this double is 2.9. set_extra_state ends in
  torch.cuda.synchronize() as TE's does.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from transformer_engine.pytorch.quantization import FP8GlobalStateManager

DEVICE_ENV = "EMBODYHPC_TE_DOUBLE_CUDA"


def device_present() -> bool:
    """Whether this process stands for a GPU node (module doc)."""
    return os.environ.get(DEVICE_ENV) == "1"


def assert_cuda_available() -> None:
    assert torch.cuda.is_available() or device_present(), "TransformerEngine needs CUDA."


def assert_cuda_input(inp: torch.Tensor) -> None:
    assert inp.is_cuda or device_present(), "TransformerEngine needs CUDA."


def _synchronize() -> None:
    if not device_present():
        torch.cuda.synchronize()  # raises on a node without CUDA, as TE's call does


class _ScalingMeta:
    """fp8_meta["scaling_fwd"/"scaling_bwd"] of delayed scaling: a scale per FP8 tensor of the GEMMs and an amax
    history of amax_history_len rows (TE's init_fp8_meta_tensors)."""

    def __init__(self, num_tensors: int, history_len: int) -> None:
        self.scale = torch.ones(num_tensors, dtype=torch.float32)
        self.amax_history = torch.zeros(history_len, num_tensors, dtype=torch.float32)


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
        assert_cuda_available()
        self.name = name
        self.param_init_meta: dict[str, _ParameterInitMeta] = {}
        self.fp8 = False
        self.fp8_calibration = False
        self.fp8_initialized = False
        self.fp8_meta: dict = {"fp8_checkpoint": False, "fp8_group": None}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        """What every forward does first: the autocast state decides fp8, fp8_checkpoint and the recipe; delayed
        scaling gets its scale and amax-history tensors once (3 forward tensors per GEMM, 2 backward)."""
        self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        self.fp8_calibration = FP8GlobalStateManager.is_fp8_calibration()
        self.fp8_meta["fp8_checkpoint"] = self.fp8 or self.fp8_calibration
        if not (self.fp8 or self.fp8_calibration):
            self.fp8_initialized = False
            return
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        if self.fp8_initialized and recipe == self.fp8_meta.get("recipe"):
            return
        self.fp8_meta["recipe"] = recipe
        self.fp8_meta["num_gemms"] = num_gemms
        self.fp8_meta["fp8_group"] = FP8GlobalStateManager.get_fp8_group()
        self.init_fp8_meta_tensors(recipe)
        self.fp8_initialized = True

    def init_fp8_meta_tensors(self, recipe) -> None:
        if recipe.delayed():
            gemms = self.fp8_meta.get("num_gemms", 1)
            self.fp8_meta["scaling_fwd"] = _ScalingMeta(3 * gemms, recipe.amax_history_len)
            self.fp8_meta["scaling_bwd"] = _ScalingMeta(2 * gemms, recipe.amax_history_len)

    def record_amax(self, *tensors: torch.Tensor) -> None:
        """Delayed scaling's bookkeeping of a forward: roll the history, write this step's amaxes, rescale."""
        meta = self.fp8_meta.get("scaling_fwd")
        if meta is None or not self.fp8_meta["recipe"].delayed():
            return
        with torch.no_grad():
            meta.amax_history = torch.roll(meta.amax_history, 1, dims=0)
            for index, tensor in enumerate(tensors):
                meta.amax_history[0, index] = tensor.detach().abs().amax().float()
            meta.scale = 448.0 / meta.amax_history.amax(dim=0).clamp(min=1e-12)

    def get_extra_state(self) -> torch.Tensor:
        if not (self.fp8_meta["fp8_checkpoint"] or self.fp8 or self.fp8_calibration):
            return torch.empty(0, dtype=torch.uint8)
        recipe = self.fp8_meta["recipe"]
        state: dict = {"recipe": recipe}
        if recipe.delayed():
            for direction in ("fwd", "bwd"):
                state[f"scale_{direction}"] = self.fp8_meta[f"scaling_{direction}"].scale.clone()
                state[f"amax_history_{direction}"] = self.fp8_meta[f"scaling_{direction}"].amax_history.clone()
        state["extra_fp8_variables"] = {key: value for key, value in self.fp8_meta.items()
                                        if key != "buffer_index_and_autocast_key"
                                        and isinstance(value, (bool, int, float, str, tuple, list))}
        _synchronize()
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        if state is None:
            return
        if not isinstance(state, torch.Tensor):
            raise RuntimeError("Unsupported checkpoint format.")
        if state.numel() == 0:
            return
        state = pickle.loads(state.detach().cpu().numpy().tobytes())
        self.fp8_meta.update(state["extra_fp8_variables"])
        self.fp8_meta["recipe"] = state["recipe"]
        self.init_fp8_meta_tensors(state["recipe"])
        if state["recipe"].delayed():
            for direction in ("fwd", "bwd"):
                self.fp8_meta[f"scaling_{direction}"].scale.copy_(state[f"scale_{direction}"])
                self.fp8_meta[f"scaling_{direction}"].amax_history.copy_(state[f"amax_history_{direction}"])
        _synchronize()

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
