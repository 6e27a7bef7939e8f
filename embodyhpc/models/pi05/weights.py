"""pi0.5 weights in the published PyTorch layout: load them into a Pi05Policy, save ours in that layout.

The published layout is the state dict of openpi's PyTorch pi0.5 (`PI0Pytorch` with pi05=True, as its JAX -> PyTorch
conversion writes it) and of LeRobot's pi0.5 (the same names under a `model.` prefix): a transformers
PaliGemmaForConditionalGeneration (SigLIP So400m/14 + Gemma 2B) and a GemmaForCausalLM action expert (Gemma 300M,
adaRMS norms) inside `paligemma_with_expert`, plus four Linear layers of the policy itself. Abbreviations below:

    V = paligemma_with_expert.paligemma.model.vision_tower.vision_model.
    M = paligemma_with_expert.paligemma.model.multi_modal_projector.
    L = paligemma_with_expert.paligemma.model.language_model.
    E = paligemma_with_expert.gemma_expert.model.

| ours                                      | theirs                                            | conversion        |
|-------------------------------------------|---------------------------------------------------|-------------------|
| vision.patch_embed.{weight,bias}          | V embeddings.patch_embedding.{weight,bias}        | same              |
| vision.position_embedding [1, P, W]       | V embeddings.position_embedding.weight [P, W]     | reshape           |
| vision.blocks.i.attn_norm                 | V encoder.layers.i.layer_norm1                    | same (LayerNorm)  |
| vision.blocks.i.{q,k,v}_proj, out_proj    | V encoder.layers.i.self_attn.{q,k,v,out}_proj     | same (split qkv)  |
| vision.blocks.i.mlp_norm                  | V encoder.layers.i.layer_norm2                    | same              |
| vision.blocks.i.fc1, fc2                  | V encoder.layers.i.mlp.fc1, fc2                   | same              |
| vision.post_norm                          | V post_layernorm                                  | same              |
| vision_projector                          | M linear                                          | same              |
| embed_tokens.weight                       | L embed_tokens.weight (or paligemma.lm_head.weight, tied) | same      |
| layers.i.vlm.attn_norm.weight             | L layers.i.input_layernorm.weight                 | same (1 + w form) |
| layers.i.vlm.{q,k,v,o}_proj               | L layers.i.self_attn.{q,k,v,o}_proj               | same (split qkv)  |
| layers.i.vlm.mlp_norm.weight              | L layers.i.post_attention_layernorm.weight        | same (pre-MLP)    |
| layers.i.vlm.mlp.{gate,up,down}_proj      | L layers.i.mlp.{gate,up,down}_proj                | same (GeGLU)      |
| layers.i.expert.attn_norm.modulation      | E layers.i.input_layernorm.dense                  | same [3D, D]      |
| layers.i.expert.{q,k,v,o}_proj            | E layers.i.self_attn.{q,k,v,o}_proj               | same              |
| layers.i.expert.mlp_norm.modulation       | E layers.i.post_attention_layernorm.dense         | same [3D, D]      |
| layers.i.expert.mlp.{gate,up,down}_proj   | E layers.i.mlp.{gate,up,down}_proj                | same              |
| final_norm.modulation [2D, D]             | E norm.dense [3D, D]                              | gate rows dropped |
| time_mlp_in, time_mlp_out                 | time_mlp_in, time_mlp_out (old: action_time_mlp_*) | same             |
| action_in, action_out                     | action_in_proj, action_out_proj                   | same              |

What the layouts agree on, so that "same" holds: Linear weights are [out, in] in both; q/k/v are separate
projections in both (no fused qkv); the MLP is GeGLU with gate_proj/up_proj/down_proj (tanh GELU on the gate);
Gemma norms store the scale as an offset from 1; the adaRMS `dense` rows are [scale | shift | gate] and the gate
multiplies the residual branch (x + gate * branch), which is how our AdaRMSNorm/StreamBlock compute it; the time
embedding (sin | cos, periods 4e-3 .. 4) feeds time_mlp_in -> swish -> time_mlp_out -> swish. SigLIP's pooling head
is absent from both (PaliGemma's vision_use_head=False).

Keys of the published layout our model does not hold (`unused_published_keys`): ignored when loading, written as
placeholders by `save_pi05_weights(..., placeholders=True)` so that their strict loaders accept our files:
- L norm.weight: the VLM's final norm; its output is never read by the action path (zeros = identity scale).
- L layers.{last}.{self_attn.q_proj, self_attn.o_proj, post_attention_layernorm, mlp.*}: the prefix stream of the
  last layer only provides keys/values (layers.JointLayer); zeros, so a model loading them computes the same actions.
- final-norm gate rows (E norm.dense rows 2D..3D): the final norm's gate has no residual branch; zeros.
- paligemma.lm_head.weight (tied to embed_tokens; LeRobot files hold it instead of embed_tokens) and
  gemma_expert.lm_head.weight: language-model heads, unused by the flow-matching policy; not written.

Refused, with a one-line error, because no mapping gives the same function:
- pi0 checkpoints (`state_proj`, plain RMSNorm `.weight` in the expert, time MLP taking [action, time]): pi0 feeds the
  state and time through the action tokens, pi0.5 through tokens and adaRMS; ours is pi0.5.
- any shape that differs from the model's (other action_dim, vocabulary, sizes): the error names the key, both
  shapes and, for the action projections, the recipe key to change.

Numerical conventions outside the state dict, kept equal to openpi so loaded weights compute the same function:
pixels in [-1, 1] into SigLIP (models/vision.py), text embeddings scaled by sqrt(width) and image tokens not scaled
(LeRobot undoes transformers' division in get_image_features), RoPE base 10000 with (first half, second half)
pairs, positions counting real tokens only, attention scale head_dim ** -0.5.

Not read: openpi's JAX (orbax) checkpoints; convert them with openpi's own JAX -> PyTorch script first.
Distributed (FSDP2) models: this module never imports torch.distributed; embodyhpc.checkpoint.sliced_weights loads
and saves sharded models with the same conversion, through ADAPTER (the spec's `weights`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from embodyhpc.models.pi05.shapes import Pi05Shape
from embodyhpc.models.weights_io import (
    KeyRule,
    LoadReport,
    PublishedWeights,
    SafetensorsCheckpoint,
    TensorSource,
    WeightsLayoutError,
    listing,
    match_rules,
    model_tensors,
    plain_tensor,
    refuse_mismatches,
)

PALIGEMMA = "paligemma_with_expert.paligemma."
VISION = PALIGEMMA + "model.vision_tower.vision_model."
LANGUAGE = PALIGEMMA + "model.language_model."
EXPERT = "paligemma_with_expert.gemma_expert.model."
LM_HEAD = PALIGEMMA + "lm_head.weight"
EXPERT_LM_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"
LAYOUT = "openpi-pytorch-pi05"  # in the metadata of the files we write
LEROBOT_PREFIX = "model."  # LeRobot's PI05Policy keeps the network under `model`
# normalisation statistics older LeRobot policy files keep next to the network: not weights
_LEROBOT_BUFFERS = ("normalize_inputs.", "normalize_targets.", "unnormalize_outputs.")
_ALIASES = {"action_time_mlp_in.": "time_mlp_in.", "action_time_mlp_out.": "time_mlp_out."}  # older names


def key_rules(shape: Pi05Shape) -> list[KeyRule]:
    """Every tensor of a Pi05Policy of this shape and where it lives in the published layout."""
    rules = [KeyRule("vision.patch_embed.weight", VISION + "embeddings.patch_embedding.weight"),
             KeyRule("vision.patch_embed.bias", VISION + "embeddings.patch_embedding.bias"),
             KeyRule("vision.position_embedding", VISION + "embeddings.position_embedding.weight", "position")]
    vision_block = {"attn_norm": "layer_norm1", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
                    "v_proj": "self_attn.v_proj", "out_proj": "self_attn.out_proj", "mlp_norm": "layer_norm2",
                    "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
    for i in range(shape.vision.depth):
        for ours, theirs in vision_block.items():
            for param in ("weight", "bias"):
                rules.append(KeyRule(f"vision.blocks.{i}.{ours}.{param}",
                                     f"{VISION}encoder.layers.{i}.{theirs}.{param}"))
    rules += [KeyRule(f"vision.post_norm.{p}", f"{VISION}post_layernorm.{p}") for p in ("weight", "bias")]
    rules += [KeyRule(f"vision_projector.{p}", f"{PALIGEMMA}model.multi_modal_projector.linear.{p}")
              for p in ("weight", "bias")]
    rules.append(KeyRule("embed_tokens.weight", LANGUAGE + "embed_tokens.weight"))
    for i in range(shape.depth):
        last = i == shape.depth - 1
        for ours, theirs in _stream_block(adaptive=False, keys_values_only=last).items():
            rules.append(KeyRule(f"layers.{i}.vlm.{ours}", f"{LANGUAGE}layers.{i}.{theirs}"))
        for ours, theirs in _stream_block(adaptive=True, keys_values_only=False).items():
            rules.append(KeyRule(f"layers.{i}.expert.{ours}", f"{EXPERT}layers.{i}.{theirs}"))
    rules += [KeyRule(f"final_norm.modulation.{p}", f"{EXPERT}norm.dense.{p}", "drop_gate") for p in ("weight", "bias")]
    for ours, theirs in (("time_mlp_in", "time_mlp_in"), ("time_mlp_out", "time_mlp_out"),
                         ("action_in", "action_in_proj"), ("action_out", "action_out_proj")):
        rules += [KeyRule(f"{ours}.{p}", f"{theirs}.{p}") for p in ("weight", "bias")]
    return rules


def _stream_block(*, adaptive: bool, keys_values_only: bool) -> dict[str, str]:
    norm = ("modulation.weight", "dense.weight"), ("modulation.bias", "dense.bias")
    norms = norm if adaptive else (("weight", "weight"),)
    block = {f"attn_norm.{o}": f"input_layernorm.{t}" for o, t in norms}
    block |= {f"{p}.weight": f"self_attn.{p}.weight" for p in ("k_proj", "v_proj")}
    if not keys_values_only:
        block |= {f"{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "o_proj")}
        block |= {f"mlp_norm.{o}": f"post_attention_layernorm.{t}" for o, t in norms}
        block |= {f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    return block


def unused_published_keys(shape: Pi05Shape) -> dict[str, tuple[int, ...]]:
    """Keys of the published layout the model does not hold, with their shapes: written as zero placeholders
    (the language-model heads are not written), ignored when loading."""
    width, heads = shape.vlm.width, shape.num_heads * shape.head_dim
    last = f"{LANGUAGE}layers.{shape.depth - 1}."
    return {LANGUAGE + "norm.weight": (width,),
            last + "self_attn.q_proj.weight": (heads, width), last + "self_attn.o_proj.weight": (width, heads),
            last + "post_attention_layernorm.weight": (width,),
            last + "mlp.gate_proj.weight": (shape.vlm.mlp_dim, width),
            last + "mlp.up_proj.weight": (shape.vlm.mlp_dim, width),
            last + "mlp.down_proj.weight": (width, shape.vlm.mlp_dim)}


def published_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The key -> shape table that `save_pi05_weights(model, ..., placeholders=True)` writes."""
    ours = {name: tuple(t.shape) for name, t in model_tensors(model).items()}
    table = {rule.theirs: rule.their_shape(ours[rule.ours]) for rule in key_rules(model.shape)}
    return table | unused_published_keys(model.shape)



# ---- conversion (pure: no model writes, usable by the FSDP-aware loader in checkpoint/) ----
def plan_load(source: TensorSource, shape: Pi05Shape, targets: Mapping[str, tuple[int, ...]], *,
              strict: bool = True, source_name: str = "checkpoint") -> tuple[LoadReport, list[tuple[KeyRule, str]]]:
    """Check the checkpoint's keys and shapes against the model's tensors (`targets`: our name -> shape).

    Returns the report and (rule, key in the file) for every tensor to load; raises WeightsLayoutError for shape
    mismatches and pi0 checkpoints always, for missing and unexpected keys when `strict`.
    """
    names = list(source.keys())
    shape_of = source.shape if isinstance(source, SafetensorsCheckpoint) else (lambda k: tuple(source[k].shape))
    lerobot = any(k.startswith(LEROBOT_PREFIX + "paligemma_with_expert.") for k in names)
    prefix = LEROBOT_PREFIX if lerobot else ""
    in_file = {_canonical(k[len(prefix):] if k.startswith(prefix) else k): k for k in names}
    _refuse_pi0(in_file, source_name)
    report = LoadReport(source=source_name, key_prefix=prefix)
    rules = key_rules(shape)
    unknown_ours = sorted(set(targets) - {r.ours for r in rules})
    if unknown_ours:
        raise WeightsLayoutError(f"the model has tensors the published pi0.5 layout has no place for: "
                                 f"{listing(unknown_ours)}")
    if LANGUAGE + "embed_tokens.weight" not in in_file and LM_HEAD in in_file:
        in_file[LANGUAGE + "embed_tokens.weight"] = in_file.pop(LM_HEAD)  # tied: LeRobot files keep lm_head only
    optional = set(unused_published_keys(shape)) | {LM_HEAD, EXPERT_LM_HEAD}
    to_load = match_rules(report, rules, in_file, targets, shape_of,
                          lambda key: key in optional or key.startswith(_LEROBOT_BUFFERS))
    refuse_mismatches(report, source_name, strict=strict, hint=_hint)
    return report, to_load


def _canonical(key: str) -> str:
    for old, new in _ALIASES.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


def _hint(key: str) -> str:
    if key.startswith(("action_in_proj.", "action_out_proj.")):
        return " (set model.action_dim to the checkpoint's action dimension, 32 for the published pi0.5)"
    if key.endswith("embed_tokens.weight"):
        return " (the vocabulary differs: model.size=full with PaliGemma's tokenizer)"
    return ""


def _refuse_pi0(in_file: Mapping[str, str], source_name: str) -> None:
    signs = [k for k in in_file if k.startswith("state_proj.")
             or re.fullmatch(re.escape(EXPERT) + r"(layers\.\d+\.(input|post_attention)_layernorm|norm)\.weight", k)]
    if signs:
        raise WeightsLayoutError(f"{source_name} is a pi0 checkpoint ({signs[0]}): pi0's expert has plain RMSNorm and "
                                 "a state projection, our model is pi0.5 (adaRMS time conditioning, state as tokens)")


def iter_converted(source: TensorSource, to_load: list[tuple[KeyRule, str]],
                   dtypes: Mapping[str, torch.dtype] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor in our layout, cast to dtypes[name] if given), one tensor at a time."""
    get: Callable[[str], torch.Tensor] = source.get if isinstance(source, SafetensorsCheckpoint) else source.__getitem__
    for rule, key in to_load:
        tensor = rule.to_ours(get(key))
        if dtypes is not None and rule.ours in dtypes:
            tensor = tensor.to(dtypes[rule.ours])
        yield rule.ours, tensor


def convert_published(source: TensorSource, shape: Pi05Shape, targets: Mapping[str, tuple[int, ...]], *,
                      strict: bool = True, dtypes: Mapping[str, torch.dtype] | None = None,
                      source_name: str = "checkpoint") -> tuple[dict[str, torch.Tensor], LoadReport]:
    """A published-layout state dict as ours (every tensor in memory at once), and the report."""
    report, to_load = plan_load(source, shape, targets, strict=strict, source_name=source_name)
    return dict(iter_converted(source, to_load, dtypes)), report


def to_published(state: Mapping[str, torch.Tensor], shape: Pi05Shape, *, placeholders: bool = True,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our state dict (plain tensors) in the published layout, CPU and contiguous; `dtype` casts floating tensors."""
    out = {}
    for rule in key_rules(shape):
        if rule.ours not in state:
            raise WeightsLayoutError(f"the state dict lacks {rule.ours!r} (is it a Pi05Policy of this shape?)")
        tensor = rule.to_theirs(plain_tensor(state[rule.ours]))
        out[rule.theirs] = tensor
    if placeholders:
        reference = state["embed_tokens.weight"]
        for key, key_shape in unused_published_keys(shape).items():
            out[key] = torch.zeros(key_shape, dtype=reference.dtype)
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).to("cpu").contiguous()
            for k, v in out.items()}


ADAPTER = PublishedWeights(LAYOUT, plan_load, to_published)


# ---- the model-level API ----
def load_pi05_weights(model: nn.Module, path_or_dir: str | Path | TensorSource, *, strict: bool = True) -> LoadReport:
    """Load published-layout pi0.5 weights (a .safetensors file, a folder with model.safetensors or a sharded
    model.safetensors.index.json, or an in-memory dict) into `model`, casting to each parameter's dtype.

    Works on a materialised model (tensors copied in place, one at a time) and on a model still on the meta device
    (tensors assigned, on the CPU). Raises WeightsLayoutError naming the keys: always for shape mismatches and pi0
    checkpoints, for missing or unexpected keys when `strict`. Sharded (FSDP) models: checkpoint.sliced_weights.
    """
    return ADAPTER.load(model, path_or_dir, strict=strict)


def save_pi05_weights(model: nn.Module, path: str | Path, *, placeholders: bool = True,
                      dtype: torch.dtype | None = None, key_prefix: str = "") -> Path:
    """Write the model's weights as one safetensors file in the published layout (see the module doc); returns path.

    `placeholders` also writes the published keys the model does not hold (zeros) so that strict loaders of the
    published layout accept the file; `dtype` casts floating tensors (e.g. torch.bfloat16); `key_prefix="model."`
    names the keys as LeRobot's policy files do (openpi's have none).
    """
    return ADAPTER.save(model, path, placeholders=placeholders, dtype=dtype, key_prefix=key_prefix)
