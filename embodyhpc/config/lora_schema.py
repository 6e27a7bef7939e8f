"""`model.lora`: low-rank adapters (LoRA) on the model's Linear layers, the base weights frozen.

    model:
      lora: {rank: 16, alpha: 16, targets: [vlm, expert]}   # openpi's pi0.5 LoRA fine-tuning (gemma_2b_lora + 300m)

Off while `rank` is unset (the default, or `model.lora.rank: null`). Pure data and its own checks; which Linear layers
the targets name is checked at validate against the family's model built on the meta device
(embodyhpc/validation/lora_checks.py), and the layers are applied by embodyhpc/models/lora.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from embodyhpc.errors import ConfigError


@dataclass(frozen=True)
class LoraConfig:
    rank: int | None = None
    """The adapters' rank r (each adapted Linear W gains A: r x in and B: out x r); null: no LoRA (full fine-tuning).
    openpi: 16 on the PaliGemma backbone (gemma_2b_lora), 32 on the action expert (gemma_300m_lora); GR00T N1.5:
    lora_rank (0 = off) on the action head."""
    alpha: float | None = None
    """The update is W + (alpha / rank) * B @ A; null: alpha = rank (scale 1, as openpi's presets: 16/16, 32/32).
    GR00T's fine-tuning script uses lora_alpha 16."""
    targets: list[str] = field(default_factory=list)
    """Which Linear layers get adapters: each entry is a preset of the family (pi0.5: vlm, expert; GR00T: action_head,
    llm) or an fnmatch pattern (`*` spans dots) matched against the Linear layers' qualified module names, e.g.
    `layers.*.expert.q_proj`; empty: the family's default presets (pi0.5: vlm + expert; GR00T: action_head). An
    entry that matches no Linear layer is refused at validate."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (GR00T's script: 0.1; openpi: none)."""

    def __post_init__(self) -> None:
        if self.rank is None:
            if self.targets or self.alpha is not None or self.dropout:
                raise ConfigError("LoRA settings without a rank (model.lora.rank is null: no adapters)",
                                  key="model.lora.rank", fix="set model.lora.rank=16 (openpi's backbone default), "
                                                             "or remove the other model.lora keys")
            return
        if self.rank <= 0:
            raise ConfigError(f"must be a positive integer, got {self.rank}", key="model.lora.rank",
                              fix="set model.lora.rank=16 (openpi), or model.lora.rank=null for no LoRA")
        if self.alpha is not None and not self.alpha > 0:
            raise ConfigError(f"must be positive, got {self.alpha:g}", key="model.lora.alpha",
                              fix=f"set model.lora.alpha={self.rank} (scale 1), or null for alpha = rank")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"must lie in [0, 1), got {self.dropout:g}", key="model.lora.dropout",
                              fix="set model.lora.dropout=0.0 (openpi) or 0.1 (GR00T)")
        for i, target in enumerate(self.targets):
            if not target.strip():
                raise ConfigError("an empty target", key=f"model.lora.targets[{i}]",
                                  fix="name a preset (pi0.5: vlm, expert; GR00T: action_head, llm) or a pattern")

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def scale(self) -> float:
        """alpha / rank: the factor of B @ A in the adapted weight."""
        assert self.rank is not None
        return (self.rank if self.alpha is None else self.alpha) / self.rank
