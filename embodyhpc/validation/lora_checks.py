"""model.lora against the rest of the recipe and the family's model: what the training job's build would refuse after
the queue wait, refused at validate (one line naming the key).

- precision.mode=fp8: the fp8 conversion swaps nn.Linear layers for torchao's or transformer-engine's, which LoRA does
  not wrap (an adapter beside an fp8 GEMM would need its own scaling recipe): refused.
- the targets: the family's model is built on the meta device (no memory, no weights) with its adapters, which resolves
  every target against the Linear layers' names (models/lora.py: a target matching no layer, or no nn.Linear, is
  refused). Only a recipe with model.lora imports torch here; where torch is not installed (a login node) the job's
  build refuses the same targets.
"""

from __future__ import annotations

from embodyhpc.config.schema import Config
from embodyhpc.errors import ConfigError


def check_lora(config: Config) -> None:
    lora = config.model.lora
    if not lora.enabled:
        return
    if config.precision.mode == "fp8":
        raise ConfigError("LoRA adapters wrap nn.Linear layers, and precision.mode=fp8 replaces them with fp8 layers",
                          key="model.lora.rank", related=("precision.mode",),
                          fix="set precision.mode=bf16 for a LoRA run, or model.lora.rank=null for full fine-tuning")
    try:
        import torch

        from embodyhpc.models import build_model
    except ImportError:  # no torch here: the training job's build checks the targets
        return
    with torch.device("meta"):
        build_model(config.model)  # apply_lora resolves the targets; ConfigErrors name model.lora.targets[i]
