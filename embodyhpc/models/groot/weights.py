"""GR00T weights in the published nvidia/GR00T-N1.5-3B layout (Isaac-GR00T's GR00T_N1_5 state dict): load them into
a GrootPolicy, write ours in that layout. embodyhpc/checkpoint/sliced_weights.py uses ADAPTER for
`model.init_weights` on FSDP-sharded models (each rank reads its rows).

    V = backbone.eagle_model.vision_model.vision_model.      L = backbone.eagle_model.language_model.

| ours                                         | theirs                                              | conversion |
|----------------------------------------------|-----------------------------------------------------|------------|
| backbone.vision.patch_embed.{weight,bias}    | V embeddings.patch_embedding.{weight,bias}          | same       |
| backbone.vision.position_embedding [1, P, W] | V embeddings.position_embedding.weight [P, W]       | reshape    |
| backbone.vision.blocks.i.attn_norm, mlp_norm | V encoder.layers.i.layer_norm1, layer_norm2         | same       |
| backbone.vision.blocks.i.{q,k,v,out}_proj    | V encoder.layers.i.self_attn.{q,k,v,out}_proj       | same       |
| backbone.vision.blocks.i.fc1, fc2            | V encoder.layers.i.mlp.fc1, fc2                     | same       |
| backbone.vision.post_norm                    | V post_layernorm                                    | same       |
| backbone.projector                           | backbone.eagle_model.mlp1.0                         | same       |
| backbone.embed_tokens, layers.i.*, norm      | L model.embed_tokens, model.layers.i.*, model.norm  | same names |
| action_head.*                                | action_head.*                                       | same names |

Published keys the model does not hold (`unused_published_keys`), ignored when loading and written by
`to_published(..., placeholders=True)`: SigLIP's attention-pooling head (V head.*, zeros: pooling is never used,
every patch token feeds the LLM) and the LLM's lm_head (tied to embed_tokens in Qwen3-1.7B's config: written as a
copy of it). LLM layers past the cut (select_layer 12) are not in the published file either.

Refused in one line (WeightsLayoutError naming the key): a pi0.5 checkpoint (paligemma_with_expert.*: set
model.name=pi05); a GR00T-N1 checkpoint (an action head without vlln / vl_self_attention); any shape that differs
from the model's, with the recipe key that changes it (action_dim for the action encoder/decoder); missing or
unexpected keys when strict (e.g. the first N1.5 release without future_tokens).
Keys may carry a prefix before `backbone.`/`action_head.` (a LeRobot policy file's attribute name); it is found and
stripped, and reported.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from embodyhpc.models.groot.shapes import GrootShape
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

EAGLE = "backbone.eagle_model."
VISION = EAGLE + "vision_model.vision_model."
LANGUAGE = EAGLE + "language_model."
LM_HEAD = LANGUAGE + "lm_head.weight"
LAYOUT = "nvidia-gr00t-n1.5"
_ROOTS = ("backbone.", "action_head.")
_VISION_BLOCK = {"attn_norm": "layer_norm1", "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
                 "v_proj": "self_attn.v_proj", "out_proj": "self_attn.out_proj", "mlp_norm": "layer_norm2",
                 "fc1": "mlp.fc1", "fc2": "mlp.fc2"}


def published_name(ours: str) -> tuple[str, str]:
    """(their key, conversion kind) of one of our parameter names."""
    if ours.startswith("action_head."):
        return ours, "same"
    name = ours[len("backbone."):]
    if name == "vision.position_embedding":
        return VISION + "embeddings.position_embedding.weight", "position"
    if name.startswith("vision.patch_embed."):
        return VISION + "embeddings.patch_embedding." + name.rsplit(".", 1)[1], "same"
    if name.startswith("vision.post_norm."):
        return VISION + "post_layernorm." + name.rsplit(".", 1)[1], "same"
    if name.startswith("vision.blocks."):
        _, _, index, module, param = name.split(".")
        return f"{VISION}encoder.layers.{index}.{_VISION_BLOCK[module]}.{param}", "same"
    if name.startswith("projector."):
        return EAGLE + "mlp1.0." + name.rsplit(".", 1)[1], "same"
    if name.startswith(("embed_tokens.", "layers.", "norm.")):
        return LANGUAGE + "model." + name, "same"
    raise WeightsLayoutError(f"the model has a tensor the published GR00T-N1.5 layout has no place for: {ours}")


def key_rules(names: list[str]) -> list[KeyRule]:
    return [KeyRule(ours, *published_name(ours)) for ours in names]


def unused_published_keys(shape: GrootShape) -> dict[str, tuple[int, ...]]:
    """Published keys our model does not hold, with their shapes (SigLIP's pooling head, the LLM's lm_head)."""
    width, mlp = shape.vision.width, shape.vision.mlp_dim
    head = VISION + "head."
    return {head + "probe": (1, 1, width), head + "attention.in_proj_weight": (3 * width, width),
            head + "attention.in_proj_bias": (3 * width,), head + "attention.out_proj.weight": (width, width),
            head + "attention.out_proj.bias": (width,), head + "layernorm.weight": (width,),
            head + "layernorm.bias": (width,), head + "mlp.fc1.weight": (mlp, width), head + "mlp.fc1.bias": (mlp,),
            head + "mlp.fc2.weight": (width, mlp), head + "mlp.fc2.bias": (width,),
            LM_HEAD: (shape.llm.vocab_size, shape.llm.width)}


def published_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every key -> shape that `to_published(..., placeholders=True)` writes for this model."""
    ours = {name: tuple(t.shape) for name, t in model_tensors(model).items()}
    table = {rule.theirs: rule.their_shape(ours[rule.ours]) for rule in key_rules(list(ours))}
    return table | unused_published_keys(model.shape)



def _prefix(names: list[str], source_name: str) -> str:
    for name in names:
        for root in _ROOTS:
            at = name.find(root)
            if at == 0 or (at > 0 and name[at - 1] == "."):
                return name[:at]
    if any(name.startswith("paligemma_with_expert.") or ".paligemma_with_expert." in name for name in names):
        raise WeightsLayoutError(f"{source_name} is a pi0.5/pi0 checkpoint (paligemma_with_expert.*), not GR00T: "
                                 "set model.name=pi05 to start from it")
    raise WeightsLayoutError(f"{source_name} holds no GR00T tensors (no backbone.* or action_head.* keys; first keys: "
                             f"{listing(sorted(names), 3)})")


def _hint(key: str) -> str:
    if key.startswith(("action_head.action_encoder.W1.", "action_head.action_decoder.layer2.")):
        return " (set model.action_dim to the checkpoint's action dimension, 32 for GR00T-N1.5)"
    if key.startswith("action_head.position_embedding"):
        return " (the checkpoint has another max_seq_len: model.size=full is GR00T-N1.5's)"
    if key.endswith("embed_tokens.weight"):
        return " (the vocabulary differs: model.size=full with Qwen3's tokenizer)"
    return ""


# ---- conversion (pure: usable by the FSDP-aware loader in checkpoint/) ----
def plan_load(source: TensorSource, shape: GrootShape, targets: Mapping[str, tuple[int, ...]], *,
              strict: bool = True, source_name: str = "checkpoint") -> tuple[LoadReport, list[tuple[KeyRule, str]]]:
    """Check the checkpoint's keys and shapes against the model's (`targets`: our name -> shape); returns the report
    and (rule, key in the file) for every tensor to load. WeightsLayoutError, one line: shape mismatches, foreign
    checkpoints (always); missing and unexpected keys (when strict)."""
    names = list(source.keys())
    shape_of = source.shape if isinstance(source, SafetensorsCheckpoint) else (lambda k: tuple(source[k].shape))
    prefix = _prefix(names, source_name)
    in_file = {k[len(prefix):]: k for k in names if k.startswith(prefix)}
    if any(k.startswith("action_head.") for k in in_file) and "action_head.vlln.weight" not in in_file:
        raise WeightsLayoutError(f"{source_name} is a GR00T-N1 checkpoint (no action_head.vlln): N1's action head "
                                 "has no VL LayerNorm and self-attention adapter, ours is GR00T-N1.5")
    report = LoadReport(source=source_name, key_prefix=prefix)
    rules = key_rules(list(targets))
    optional = set(unused_published_keys(shape))
    to_load = match_rules(report, rules, in_file, targets, shape_of, optional.__contains__)
    report.unexpected += [k for k in names if not k.startswith(prefix)]
    refuse_mismatches(report, source_name, strict=strict, hint=_hint, details=4)
    return report, to_load


def to_published(state: Mapping[str, torch.Tensor], shape: GrootShape, *, placeholders: bool = True,
                 dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Our state dict in the published layout, CPU and contiguous; `dtype` casts floating tensors."""
    out = {rule.theirs: rule.to_theirs(plain_tensor(state[rule.ours])) for rule in key_rules(list(state))}
    if placeholders:
        embed = out[LANGUAGE + "model.embed_tokens.weight"]
        for key, key_shape in unused_published_keys(shape).items():
            out[key] = embed.clone() if key == LM_HEAD else torch.zeros(key_shape, dtype=embed.dtype)
    return {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).to("cpu").contiguous()
            for k, v in out.items()}


ADAPTER = PublishedWeights(LAYOUT, plan_load, to_published)


def load_groot_weights(model: nn.Module, path_or_dir: str | Path | TensorSource, *, strict: bool = True) -> LoadReport:
    """Load published-layout GR00T-N1.5 weights (a .safetensors file, a folder with model.safetensors or a sharded
    index, or an in-memory dict) into `model`, casting to each parameter's dtype; a meta model gets them assigned."""
    return ADAPTER.load(model, path_or_dir, strict=strict)


def save_groot_weights(model: nn.Module, path: str | Path, *, placeholders: bool = True,
                       dtype: torch.dtype | None = None) -> Path:
    """The model's weights as one safetensors file in the published layout; returns the path."""
    return ADAPTER.save(model, path, placeholders=placeholders, dtype=dtype)
