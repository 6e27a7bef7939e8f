"""GR00T's builders for its spec: the policy and its instruction tokenizer."""

from __future__ import annotations

from embodyhpc.errors import ConfigError
from embodyhpc.models.groot.model import GrootPolicy
from embodyhpc.models.groot.shapes import shape_for
from embodyhpc.models.lora import apply_lora

LORA_PRESETS = {
    # Isaac-GR00T's get_lora_model (action head only, its default): the attention projections of the DiT and of the
    # VL self-attention in front of it
    "action_head": ("action_head.*.attn1.to_[qkv]",),
    # its lora_full_model counterpart on the Eagle LLM: attention and MLP projections
    "llm": ("backbone.layers.*.self_attn.[qkvo]_proj", "backbone.layers.*.mlp.*_proj"),
}
LORA_DEFAULT = ("action_head",)


def options_of(model_cfg):
    from embodyhpc.models.groot import SPEC

    return SPEC.parse_options(model_cfg.options)


def build_groot(model_cfg, precision_cfg=None) -> GrootPolicy:
    """A GrootPolicy from the recipe's `model` section (and `precision` for fp8), on the current default device; with
    model.lora, frozen with adapters on the targeted Linear layers (models/lora.py)."""
    options = options_of(model_cfg)
    model = GrootPolicy(shape_for(model_cfg.size), action_horizon=model_cfg.action_horizon,
                        action_dim=model_cfg.action_dim, attention_backend=model_cfg.attention_backend,
                        tune_llm=options.tune_llm, tune_visual=options.tune_visual)
    if precision_cfg is not None and precision_cfg.mode == "fp8":
        from embodyhpc.models.fp8 import convert_to_fp8

        convert_to_fp8(model, precision_cfg)
    apply_lora(model, getattr(model_cfg, "lora", None), LORA_PRESETS, LORA_DEFAULT)
    return model


def build_groot_tokenizer(model_cfg):
    """tiny: the byte tokenizer; full: Qwen3's tokenizer.json at model.tokenizer_path (its ids must fit the
    151680 embeddings)."""
    from embodyhpc.models.tokenizer import ByteTokenizer, load_tokenizer

    vocab_size = shape_for(model_cfg.size).llm.vocab_size
    if model_cfg.tokenizer_path is None:
        if model_cfg.size == "full":
            raise ConfigError("size full needs the tokenizer its 151680-id vocabulary comes from",
                              key="model.tokenizer_path",
                              fix="set model.tokenizer_path=/path/to/qwen3/tokenizer.json (a local tokenizers file)")
        return ByteTokenizer()
    tokenizer = load_tokenizer(model_cfg.size, model_cfg.tokenizer_path)
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids, more than the {vocab_size} embeddings of "
                          f"size {model_cfg.size}", key="model.tokenizer_path",
                          fix="use the tokenizer the size was trained with (full: Eagle 2.5's Qwen3 tokenizer.json)")
    return tokenizer


def max_text_tokens(model_cfg, num_cameras: int) -> int:
    """Instruction tokens left in model.max_token_len after the cameras' image tokens."""
    fixed = num_cameras * shape_for(model_cfg.size).vision.num_patches
    room = model_cfg.max_token_len - fixed
    if room < 8:
        raise ConfigError(f"max_token_len={model_cfg.max_token_len} leaves {room} instruction tokens after "
                          f"{num_cameras} camera(s) x {fixed // num_cameras} image tokens", key="model.max_token_len",
                          fix=f"set model.max_token_len={fixed + 64} or more")
    return room
