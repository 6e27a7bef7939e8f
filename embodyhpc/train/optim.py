"""AdamW with two parameter groups: weight decay on matrices, none on norms, biases and embeddings.

Why these exclusions: decay pulls weights toward zero. For a norm's gain that means toward "switch this channel
off" and for a bias toward an arbitrary offset, neither a useful prior; embeddings are rows looked up sparsely,
so decay would shrink rare tokens (and learned position embeddings) at every step although they get few
gradients. This is the usual GPT/PaliGemma practice.

The test is structural, not name-based, so it holds for any model: a parameter owned by an nn.Embedding, or with
fewer than 2 dims (biases, norm gains), or a free tensor whose name ends in "embedding" (vision position
embeddings, registered as bare Parameters). It runs after FSDP2 wrapping: DTensor parameters report their global
shape, so a sharded matrix is still recognised as one.
"""

from __future__ import annotations

import torch
from torch import nn


def no_decay_names(model: nn.Module) -> set[str]:
    """Fully qualified names of the parameters that get no weight decay (see the module doc)."""
    names: set[str] = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, nn.Embedding) or param.ndim < 2 or param_name.endswith("embedding"):
                names.add(full)
    return names


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over every trainable parameter, in a decayed and a non-decayed group (in that order)."""
    skip = no_decay_names(model)
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if name in skip else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)
