"""GR00T-N1.5 (NVIDIA's VLA, published design) in our own PyTorch, the second model family: see model.py.

The folder is a model plug-in (embodyhpc/models/spec.py): SPEC names its builder and tokenizer (build.py), batch
builder and token counts (batching.py), evaluation-time inference (inference.py), published-weights key rules
(weights.py) and what `embodyhpc smoke` trains (smoke.py). Its own options live under `model.options`
(GrootOptions); the model keys it reads are size (SPEC.sizes: tiny | full), the family keys SPEC.keys declares
(attention_backend, tokenizer_path (full: Qwen3's tokenizer.json), max_token_len (VLM tokens per packed row),
packing) and those every model reads (init_weights, action_horizon (16 in GR00T-N1.5), action_dim (32), state_key,
state_norm, norm_stats). Importing the package imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from embodyhpc.errors import ConfigError
from embodyhpc.models.groot.shapes import SHAPES
from embodyhpc.models.spec import ModelSpec

NUM_EMBODIMENTS = 32
NEW_EMBODIMENT = 31  # GR00T's id for a robot it was not pretrained on


@dataclass(frozen=True)
class GrootOptions:
    embodiment_id: int = NEW_EMBODIMENT
    """Which per-embodiment state encoder, action encoder and decoder weights the robot uses (0..31; GR00T's ids:
    new_embodiment 31, gr1 24, agibot_genie1 26, oxe_droid 17)."""
    tune_llm: bool = False
    """Train the LLM (and its token embedding); GR00T fine-tunes with it frozen."""
    tune_visual: bool = False
    """Train the vision tower and its projector; GR00T fine-tunes with them frozen."""

    def __post_init__(self) -> None:
        if not 0 <= self.embodiment_id < NUM_EMBODIMENTS:
            raise ConfigError(f"must be in 0..{NUM_EMBODIMENTS - 1}, got {self.embodiment_id}",
                              key="model.options.embodiment_id", fix=f"use {NEW_EMBODIMENT} (new_embodiment) for a "
                                                                      "robot GR00T was not pretrained on")


def check_model(model_cfg) -> None:
    """The shared model keys, as GR00T reads them (at validate, without torch)."""
    import dataclasses

    from embodyhpc.models.groot.shapes import shape_for

    defaults = {f.name: f.default for f in dataclasses.fields(model_cfg)}
    for key in ("state_input", "state_dim"):  # pi0.5's: set here, they would change nothing
        if getattr(model_cfg, key) != defaults[key]:
            raise ConfigError(f"model.{key} is a pi0.5 option; GR00T always feeds the state, zero-padded to 64 dims, "
                              "to its per-embodiment state encoder", key=f"model.{key}", fix=f"remove model.{key}")
    shape = shape_for(model_cfg.size)
    if model_cfg.action_horizon > shape.head.max_seq_len:
        raise ConfigError(f"{model_cfg.action_horizon} steps exceed the {shape.head.max_seq_len} action positions of "
                          f"size {model_cfg.size}", key="model.action_horizon", fix="set model.action_horizon=16")


SPEC = ModelSpec(
    name="groot",
    options=GrootOptions,
    sizes=tuple(SHAPES),
    keys=("attention_backend", "tokenizer_path", "max_token_len", "packing"),
    check=check_model,
    build="embodyhpc.models.groot.build:build_groot",
    tokenizer="embodyhpc.models.groot.build:build_groot_tokenizer",
    collate="embodyhpc.models.groot.batching:GrootCollate",
    token_count="embodyhpc.models.groot.batching:batch_tokens",
    token_budget="embodyhpc.models.groot.batching:batch_token_budget",
    inference="embodyhpc.models.groot.inference:GrootRunner",
    weights="embodyhpc.models.groot.weights:ADAPTER",
    smoke="embodyhpc.models.groot.smoke:SMOKE",
    check_dataset="embodyhpc.models.groot.dataset_fit:check_dataset",
    tokenizer_file=(("full", ("the full-size GR00T needs Eagle 2.5's Qwen3 tokenizer file",
                              "/path/to/eagle2.5/tokenizer.json")),),
)
