"""Linear as in transformer_engine/pytorch/module/linear.py (v2.9-v2.18), without tensor parallelism, parameter splits
or userbuffers: `weight` [out, in] and `bias` registered as parameters (bias=False leaves `bias` an empty plain
tensor attribute, as TE does), built on `device` (default "cuda") and initialised at once unless `device == "meta"`
(a string comparison in TE: torch.device("meta") == "meta" is False, so a torch.device meta build is initialised on
cuda).

forward (`@no_torch_dynamo()`, as TE's: a compiled caller graph-breaks here): asserts the input is on CUDA
(module/base.py doc), then inside autocast (FP8GlobalStateManager.is_fp8_enabled()) the GEMM runs in FP8, which
requires the input's leading dims to multiply to a multiple of 8 and its last dim to be a multiple of 16
(utils.assert_dim_for_fp8_exec on input and weight); outside autocast it runs in the parameters' precision. The
double simulates the FP8 GEMM by rounding input and weight through float8_e4m3fn (per-tensor current scaling,
straight-through gradient) and counts forwards in `fp8_forwards` and `high_precision_forwards` (test bookkeeping, not
TE API).

backward: refuses to run while an enabled te.autocast region is open (quantization.py's module doc: TE documents the
backward outside the region and silently runs a different amax/scale schedule otherwise; the double raises an
AssertionError from loss.backward()). Checked for every forward that records a graph, in FP8 or not.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from transformer_engine.pytorch.distributed import in_fp8_activation_recompute_phase
from transformer_engine.pytorch.jit import no_torch_dynamo
from transformer_engine.pytorch.module.base import (
    TransformerEngineBaseModule,
    assert_cuda_input,
    init_method_constant,
)
from transformer_engine.pytorch.quantization import FP8GlobalStateManager, assert_backward_outside_autocast

_E4M3_MAX = 448.0


class _BackwardOutsideAutocast(torch.autograd.Function):
    """Identity in forward; its backward (the first of the layer's) refuses an open FP8 region."""

    @staticmethod
    def forward(ctx, out: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        assert_backward_outside_autocast()
        return grad


def assert_dim_for_fp8_exec(*tensors: torch.Tensor) -> None:
    for tensor in tensors:
        assert math.prod(tensor.shape[:-1]) % 8 == 0 and tensor.shape[-1] % 16 == 0, (
            "FP8 execution requires the product of all dimensions except the last to be divisible"
            " by 8 and the last dimension to be divisible by 16, but got tensor with"
            f" dims={list(tensor.size())}")


def _fake_fp8(tensor: torch.Tensor) -> torch.Tensor:
    scale = _E4M3_MAX / tensor.detach().abs().amax().float().clamp(min=1e-12)
    rounded = (tensor.detach().float() * scale).to(torch.float8_e4m3fn).float() / scale
    return tensor + (rounded.to(tensor.dtype) - tensor).detach()


class Linear(TransformerEngineBaseModule):
    def __init__(self, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name=None, init_method=None, bias: bool = True, return_bias: bool = False,
                 params_dtype: torch.dtype | None = None, parallel_mode: str | None = None, parameters_split=None,
                 device: torch.device | str = "cuda", ub_overlap_ag: bool = False, ub_overlap_rs: bool = False,
                 ub_overlap_rs_dgrad: bool = False, ub_bulk_dgrad: bool = False, ub_bulk_wgrad: bool = False,
                 ub_name: str | None = None, delay_wgrad_compute: bool = False, symmetric_ar_type=None,
                 save_original_input: bool = False, name: str | None = None) -> None:
        super().__init__(name)
        params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bias
        if device == "meta":
            assert parameters_split is None, "Cannot split module parameters on 'meta' device."
        weight = torch.empty(out_features, in_features, device=device, dtype=params_dtype)
        self.register_parameter("weight", torch.nn.Parameter(weight), init_fn=init_method)
        if bias:
            self.register_parameter("bias", torch.nn.Parameter(torch.empty(out_features, device=device,
                                                                           dtype=params_dtype)),
                                    init_fn=init_method_constant(0.0))
        else:
            self.bias = torch.Tensor().to(dtype=params_dtype, device=device)
        self.reset_parameters(defer_init=device == "meta")
        self.fp8_forwards = 0
        self.high_precision_forwards = 0

    @no_torch_dynamo()
    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None, fp8_output: bool = False,
                fp8_grad: bool = False) -> torch.Tensor:
        if not (self.fp8 and in_fp8_activation_recompute_phase()):  # prepare_forward
            assert_cuda_input(inp)
            self.init_fp8_metadata()
        else:
            self.fp8 = FP8GlobalStateManager.is_fp8_enabled()
        weight = self.weight
        bias = self.bias if self.use_bias else None
        if self.fp8:
            assert_dim_for_fp8_exec(inp, weight)
            self.record_amax(inp, weight)
            self.fp8_forwards += 1
            bias = None if bias is None else bias.to(inp.dtype)
            out = F.linear(_fake_fp8(inp), _fake_fp8(weight).to(inp.dtype), bias)
        else:
            self.high_precision_forwards += 1
            out = F.linear(inp, weight.to(inp.dtype), None if bias is None else bias.to(inp.dtype))
        return _BackwardOutsideAutocast.apply(out) if out.requires_grad else out
