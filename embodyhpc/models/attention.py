"""Attention over packed prefix-LM batches: one interface (`attend`), several kernels behind it.

The mask (pi0 / pi0.5). A row of a batch holds the tokens of one or more samples (packing). Each token has a
segment id (its sample's slot in the row, PAD_SEGMENT for padding) and belongs either to its sample's prefix
(image patches, instruction and discretised state) or to its action chunk. A query may see a key iff

    same segment  and  (the key is a prefix token  or  the query is an action token)

so the prefix attends bidirectionally among itself and never to actions, and action tokens see the whole prefix
of their sample and every action token of their sample (the chunk is bidirectional, as in pi0). Padding tokens
count as prefix tokens of the padding segment: they see only padding, so every softmax row stays finite and
real tokens never see padding.

A causal layout (`causal=True`, a decoder LLM such as GR00T's Qwen3 over packed samples) has prefix tokens only,
queries = keys, and adds: a key is visible iff it is not later in its segment than the query (token order within
the row). Varlen kernels get it as their own causal flag (each segment's queries and keys are the same tokens, so
flash-attn's bottom-right alignment is the usual lower triangle).

Queries and keys are described separately (`AttentionLayout`), which covers both training (queries = keys =
the packed sequence) and cached inference (queries = the action tokens, keys = the cached prefix + the action
tokens). Tokens of a sample need not be contiguous: the model concatenates its two streams (prefix, actions)
along the sequence, and only segment ids and prefix flags decide what is visible.

Backends (`BACKENDS`); all take q [B, Tq, Hq, D] and k, v [B, Tk, Hkv, D] (multi-query: Hkv = 1 divides Hq):
- sdpa_reference: SDPA with the dense boolean mask; the CPU reference every other backend is tested against.
- sdpa_segments: the varlen plan of attention_varlen run by a CPU varlen kernel (one flash-attention call per
  segment, as a custom op with flash-attn's calling convention), the CPU stand-in of the two GPU varlen kernels.
- flex: FlexAttention with a block mask, compiled (dynamic shapes). No backward on CPU in torch 2.13 (measured),
  so on CPU it serves inference only.
- flash_varlen: flash_attn_varlen_func (flash-attn 2, CUDA only; PyPI has no wheel, it builds against CUDA).
- torch_varlen: torch.nn.attention.varlen.varlen_attn (CUDA only: no CPU kernel in 2.13).
"auto" picks flash_varlen, then torch_varlen (both need fp16/bf16 inputs), then flex on CUDA. On CPU it picks
sdpa_segments for packed rows (2+ samples per row on average) and sdpa_reference otherwise. Measured here, fp32
forward+backward, 4 heads: 4 rows x 512 tokens x 2 samples 34 vs 43 ms, 2 x 2048 x 8 samples (8 heads) 275 vs
1218 ms; one sample per row (16 x 256) 118 vs 71 ms. flex is not a CPU candidate: it materialises the scores
too, after a mask construction of seconds, and has no backward.

Planning happens before the layers, once per pass: `AttentionLayout.prepare` resolves the backend and builds what
its kernel reads (dense mask, varlen plan or block mask) with every data-dependent op (nonzero, unique, bincount,
host reads of lengths) there, and returns a PreparedAttention that the model hands to every layer. Inside a
layer, `attend(q, k, v, prepared=...)` only gathers, calls the kernel and scatters: no host sync and nothing a
compiled block would break its graph on or recompile for beyond the tensors' sizes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from embodyhpc.errors import ConfigError

PAD_SEGMENT = -1
BACKENDS = ("sdpa_reference", "sdpa_segments", "flex", "flash_varlen", "torch_varlen")
CPU_TRAINING_BACKENDS = ("sdpa_reference", "sdpa_segments")
_KEY = "model.attention_backend"


@dataclass(frozen=True, eq=False)
class AttentionLayout:
    """Who may see whom (see the module doc). Derived forms (dense mask, varlen plan, block mask) are cached,
    so one layout shared by every layer of a forward pass pays for them once."""

    q_segment_ids: torch.Tensor  # [B, Tq] int64, PAD_SEGMENT for padding
    q_is_prefix: torch.Tensor  # [B, Tq] bool (True for padding)
    k_segment_ids: torch.Tensor  # [B, Tk] int64
    k_is_prefix: torch.Tensor  # [B, Tk] bool
    causal: bool = False  # within each segment, a query sees no later key (prefix-only self-attention)

    def __post_init__(self) -> None:
        if self.q_segment_ids.shape != self.q_is_prefix.shape or self.k_segment_ids.shape != self.k_is_prefix.shape:
            raise ValueError("segment ids and prefix flags must have the same shape on each side")
        if self.q_segment_ids.shape[0] != self.k_segment_ids.shape[0]:
            raise ValueError("queries and keys must have the same number of rows")
        if self.causal and (self.q_segment_ids is not self.k_segment_ids or self.q_is_prefix is not self.k_is_prefix):
            raise ValueError("a causal layout is a self-attention layout: build it with self_attention(causal=True)")

    @classmethod
    def self_attention(cls, segment_ids: torch.Tensor, is_prefix: torch.Tensor, *,
                       causal: bool = False) -> AttentionLayout:
        """Queries and keys are the same tokens (training, and the prefix pass of inference). `causal`: a decoder's
        mask within each segment; every token must then be a prefix token."""
        segment_ids = segment_ids.long()
        is_prefix = is_prefix | (segment_ids == PAD_SEGMENT)
        return cls(segment_ids, is_prefix, segment_ids, is_prefix, causal)

    @classmethod
    def causal_segments(cls, segment_ids: torch.Tensor) -> AttentionLayout:
        """A decoder over packed samples: causal within each segment, nothing across segments."""
        return cls.self_attention(segment_ids, torch.ones_like(segment_ids, dtype=torch.bool), causal=True)

    @cached_property
    def ranks(self) -> torch.Tensor:
        """[B, T] int64: each token's index among the tokens of its segment in its row (causal layouts)."""
        slots = self.q_segment_ids - PAD_SEGMENT
        one_hot = F.one_hot(slots, int(slots.max()) + 1 if slots.numel() else 1)
        return (one_hot.cumsum(1) * one_hot).sum(-1) - 1

    def _check_causal(self) -> None:
        if self.causal and not bool(self.q_is_prefix.all()):
            raise ValueError("a causal layout has prefix tokens only (the prefix-LM's action tokens are bidirectional)")

    @classmethod
    def from_prefix_lengths(cls, segment_ids: torch.Tensor, position_ids: torch.Tensor,
                            prefix_lens: torch.Tensor) -> AttentionLayout:
        """From the single-stream packed form of embodyhpc.data.packing (samples contiguous, positions restarting
        at 0 per sample, prefix_lens [B, max_segments] per slot)."""
        segment_ids = segment_ids.long()
        is_pad = segment_ids == PAD_SEGMENT
        slot = torch.where(is_pad, 0, segment_ids)
        is_prefix = position_ids < torch.gather(prefix_lens.long(), 1, slot)
        return cls.self_attention(segment_ids, is_prefix)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(rows, query tokens, key tokens)."""
        return (*self.q_segment_ids.shape, self.k_segment_ids.shape[1])

    @cached_property
    def samples_per_row(self) -> float:
        """Mean number of (non-padding) samples per row among the queries."""
        rows = self.q_segment_ids.shape[0]
        keys = self.q_segment_ids + torch.arange(rows, device=self.q_segment_ids.device)[:, None] * (2 ** 32)
        return torch.unique(keys[self.q_segment_ids != PAD_SEGMENT]).numel() / max(rows, 1)

    def prepare(self, backend: str = "auto", *, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None, needs_grad: bool = False) -> PreparedAttention:
        """Resolve `backend` for this device, dtype and pass, and build everything its kernel reads (the only
        place data-dependent ops run). `device` defaults to the layout's."""
        device = torch.device(device) if device is not None else self.q_segment_ids.device
        packed = backend == "auto" and device.type == "cpu" and self.samples_per_row >= 2.0
        name = resolve_backend(backend, device=device, needs_grad=needs_grad, dtype=dtype, packed=packed)
        dense = self.dense_mask if name == "sdpa_reference" else None
        varlen = self.varlen_plan if name in VARLEN_BACKENDS else None
        block = self.flex_block_mask if name == "flex" else None
        return PreparedAttention(name, dense_mask=dense, varlen=varlen, block_mask=block)

    @cached_property
    def dense_mask(self) -> torch.Tensor:
        """[B, Tq, Tk] bool, True where the query may see the key."""
        self._check_causal()
        same = self.q_segment_ids[:, :, None] == self.k_segment_ids[:, None, :]
        visible = self.k_is_prefix[:, None, :] | ~self.q_is_prefix[:, :, None]
        mask = same & visible
        if self.causal:
            mask = mask & (self.ranks[:, None, :] <= self.ranks[:, :, None])
        if not bool(mask.any(dim=-1).all()):
            raise ValueError("a query token has no visible key: its segment has no prefix key (or no key at all)")
        return mask

    @cached_property
    def varlen_plan(self):  # -> attention_varlen.VarlenPlan (imported lazily: that module imports this one)
        from embodyhpc.models.attention_varlen import build_varlen_plan

        self._check_causal()
        return build_varlen_plan(self)

    @cached_property
    def flex_block_mask(self):
        from torch.nn.attention.flex_attention import create_block_mask

        self._check_causal()
        q_seg, q_pre, k_seg, k_pre = self.q_segment_ids, self.q_is_prefix, self.k_segment_ids, self.k_is_prefix
        ranks = self.ranks if self.causal else None

        def mask_mod(b, h, q_idx, kv_idx):
            visible = (q_seg[b, q_idx] == k_seg[b, kv_idx]) & (k_pre[b, kv_idx] | ~q_pre[b, q_idx])
            return visible & (ranks[b, kv_idx] <= ranks[b, q_idx]) if ranks is not None else visible

        rows, num_q, num_k = self.shape
        return create_block_mask(mask_mod, rows, None, num_q, num_k, device=q_seg.device)


@dataclass(frozen=True, eq=False)
class PreparedAttention:
    """A layout planned for one backend (AttentionLayout.prepare): what the kernel reads, nothing else."""

    backend: str
    dense_mask: torch.Tensor | None = None  # sdpa_reference: [B, Tq, Tk] bool
    varlen: object | None = None  # varlen backends: attention_varlen.VarlenPlan
    block_mask: object | None = None  # flex: torch.nn.attention.flex_attention.BlockMask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: AttentionLayout | None = None,
           backend: str = "auto", scale: float | None = None,
           prepared: PreparedAttention | None = None) -> torch.Tensor:
    """Masked attention of q [B, Tq, Hq, D] over k, v [B, Tk, Hkv, D] -> [B, Tq, Hq, D]; scale defaults to D**-0.5.

    Pass `prepared` (planned once per pass, see the module doc) from model code; `layout` (+ `backend`) plans on
    the spot, for tests and one-off calls.
    """
    if prepared is None:
        if layout is None:
            raise TypeError("attend needs a layout or a prepared plan")
        if q.shape[0] != layout.shape[0] or q.shape[1] != layout.shape[1] or k.shape[1] != layout.shape[2]:
            raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} do not match the layout {layout.shape}")
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        prepared = layout.prepare(backend, device=q.device, dtype=q.dtype, needs_grad=needs_grad)
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{q.shape[2]} query heads are not a multiple of {k.shape[2]} key/value heads")
    return _IMPLEMENTATIONS[prepared.backend](q, k, v, prepared, scale)


def resolve_backend(name: str, *, device: torch.device | str, needs_grad: bool, dtype: torch.dtype | None = None,
                    packed: bool = False) -> str:
    """The backend `attend` runs for `name` on `device` with inputs of `dtype` (`packed`: rows hold 2+ samples on
    average); ConfigError (naming the recipe key) if it cannot run."""
    device_type = torch.device(device).type
    if name == "auto":
        if device_type == "cuda":
            for candidate in ("flash_varlen", "torch_varlen"):
                if backend_unavailable_reason(candidate, device_type, dtype) is None:
                    return candidate
            return "flex"
        return "sdpa_segments" if packed else "sdpa_reference"
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; known: auto, {', '.join(BACKENDS)}", key=_KEY)
    reason = backend_unavailable_reason(name, device_type, dtype)
    if reason is None and needs_grad and device_type == "cpu" and name == "flex":
        reason = "FlexAttention has no backward on CPU (it serves CPU inference only)"
    if reason is not None:
        raise ConfigError(f"{name} cannot run here: {reason}", key=_KEY,
                          fix=f"set {_KEY}=auto or sdpa_reference on this machine")
    return name


def backend_unavailable_reason(name: str, device_type: str, dtype: torch.dtype | None = None) -> str | None:
    """Why `name` cannot run on this device type (and input dtype, if given) at all; None if it can."""
    if name in ("flash_varlen", "torch_varlen") and device_type != "cuda":
        return f"{name} has CUDA kernels only (device is {device_type})"
    if name in ("flash_varlen", "torch_varlen") and dtype not in (None, torch.float16, torch.bfloat16):
        return f"{name} needs float16 or bfloat16 inputs, got {dtype} (train with precision.mode=bf16 or fp8)"
    if name == "flash_varlen" and not _flash_attn_installed():
        return ("flash-attn 2 is not installed: `from flash_attn import flash_attn_varlen_func` fails (flash-attn 4 "
                "ships only flash_attn.cute; pip install 'flash-attn>=2.7,<3' --no-build-isolation, on a GPU node)")
    if name == "torch_varlen" and importlib.util.find_spec("torch.nn.attention.varlen") is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    return None


@functools.lru_cache(maxsize=1)
def _flash_attn_installed() -> bool:
    """Whether flash-attn 2's varlen function imports: the package name alone is not enough (flash-attn 4 installs
    a `flash_attn` package holding only `flash_attn.cute`, and a broken build fails only at import)."""
    try:
        return callable(importlib.import_module("flash_attn").flash_attn_varlen_func)
    except (ImportError, AttributeError, OSError):
        return False


def repeat_kv(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[..., Hkv, D] -> [..., Hq, D]: key/value head j serves query heads j*g .. j*g+g-1 (g = Hq / Hkv)."""
    group = num_q_heads // x.shape[-2]
    return x if group == 1 else x.repeat_interleave(group, dim=-2)


def _sdpa_reference(q, k, v, prepared: PreparedAttention, scale):
    k, v = repeat_kv(k, q.shape[2]), repeat_kv(v, q.shape[2])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=prepared.dense_mask[:, None], scale=scale)
    return out.transpose(1, 2)


FLEX_COMPILE_BACKEND = "inductor"
"""torch.compile backend of flex_attention: inductor fuses it (the GPU kernel and its backward). CPU tests set
"eager" (the same dynamo path, lowered without inductor's seconds of C++ compilation per shape)."""


def _compiled_flex() -> Callable:
    return _compile_flex(FLEX_COMPILE_BACKEND)


@functools.lru_cache(maxsize=2)
def _compile_flex(backend: str) -> Callable:
    """flex_attention compiled once for all shapes (dynamic=True: with dynamic=False every new (B, Tq, Tk)
    recompiled, and after torch's cache limit of 8 it fell back to the unfused path that materialises every
    score). Inside a compiled block this wrapper is inlined into the block's graph."""
    from torch.nn.attention import flex_attention as flex

    return torch.compile(flex.flex_attention, dynamic=True, backend=backend)


def _flex(q, k, v, prepared: PreparedAttention, scale):
    if not torch.is_grad_enabled():
        # torch refuses CPU inputs that require grad even under no_grad; no graph is recorded here anyway
        q, k, v = q.detach(), k.detach(), v.detach()
    out = _compiled_flex()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=prepared.block_mask,
                           scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


def _varlen(kernel_name: str):
    def run(q, k, v, prepared: PreparedAttention, scale):
        from embodyhpc.models import attention_varlen

        return attention_varlen.varlen_attend(q, k, v, prepared.varlen, kernel_name, scale)

    return run


VARLEN_BACKENDS = ("sdpa_segments", "flash_varlen", "torch_varlen")
_IMPLEMENTATIONS: dict[str, Callable] = {
    "sdpa_reference": _sdpa_reference,
    "sdpa_segments": _varlen("sdpa_segments"),
    "flex": _flex,
    "flash_varlen": _varlen("flash_varlen"),
    "torch_varlen": _varlen("torch_varlen"),
}
