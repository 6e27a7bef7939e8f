"""pi0.5's builders for its spec: the policy, its prompt tokenizer, and the prompt budget a recipe leaves."""

from __future__ import annotations

from embodyhpc.errors import ConfigError
from embodyhpc.models.lora import apply_lora
from embodyhpc.models.pi05.model import Pi05Policy
from embodyhpc.models.pi05.shapes import shape_for

LORA_PRESETS = {
    # openpi's gemma_2b_lora: the PaliGemma backbone's attention and MLP projections
    "vlm": ("layers.*.vlm.[qkvo]_proj", "layers.*.vlm.mlp.*_proj"),
    # openpi's gemma_300m_lora: the action expert's
    "expert": ("layers.*.expert.[qkvo]_proj", "layers.*.expert.mlp.*_proj"),
}
LORA_DEFAULT = ("vlm", "expert")  # openpi's pi0.5 LoRA fine-tuning adapts both


def build_pi05(model_cfg, precision_cfg=None) -> Pi05Policy:
    """A Pi05Policy from the recipe's `model` section (and `precision` for fp8), on the current default device:
    build under `torch.device("meta")` for large sizes, then `to_empty(...)` and `init_weights()`. With model.lora,
    the base is frozen and the targeted Linear layers carry adapters (models/lora.py)."""
    model = Pi05Policy(shape_for(model_cfg.size), action_horizon=model_cfg.action_horizon,
                       action_dim=model_cfg.action_dim, attention_backend=model_cfg.attention_backend,
                       state_dim=model_cfg.state_dim if getattr(model_cfg, "state_input", "prompt") == "expert" else 0)
    if precision_cfg is not None and precision_cfg.mode == "fp8":
        from embodyhpc.models.fp8 import convert_to_fp8

        convert_to_fp8(model, precision_cfg)
    apply_lora(model, getattr(model_cfg, "lora", None), LORA_PRESETS, LORA_DEFAULT)
    return model


def build_pi05_tokenizer(model_cfg):
    """The prompt tokenizer; its ids must fit the size's embedding table."""
    from embodyhpc.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_cfg.size, model_cfg.tokenizer_path)
    vocab_size = shape_for(model_cfg.size).vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids, more than the {vocab_size} embeddings "
                          f"of size {model_cfg.size}", key="model.tokenizer_path",
                          fix="use the tokenizer the size was trained with (full: PaliGemma's SentencePiece model)")
    return tokenizer


def max_prompt_tokens(model_cfg, num_cameras: int) -> int:
    """Prompt tokens (instruction + state) left in model.max_token_len after the images and the action chunk."""
    shape = shape_for(model_cfg.size)
    fixed = num_cameras * shape.vision.num_patches + model_cfg.action_horizon
    room = model_cfg.max_token_len - fixed
    if room < 8:
        raise ConfigError(
            f"max_token_len={model_cfg.max_token_len} leaves {room} prompt tokens after {num_cameras} camera(s) x "
            f"{shape.vision.num_patches} patches and {model_cfg.action_horizon} action tokens",
            key="model.max_token_len", fix=f"set model.max_token_len={fixed + 64} or more")
    return room
