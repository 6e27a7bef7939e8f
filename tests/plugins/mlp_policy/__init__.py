"""A small non-pi0.5 policy as a model plug-in: an MLP from the (normalised) state to an action chunk.

Everything the project needs of it is in this folder: SPEC (what embodyhpc/models/spec.py asks for), its own
options (model.options.*), the network (model.py). Job processes find it through the `embodyhpc.models` entry point
that the test installs (test_mlp_policy.py); importing this module imports no torch, so `validate` stays light.
"""

from __future__ import annotations

from dataclasses import dataclass

from embodyhpc.errors import ConfigError
from embodyhpc.models.spec import ModelSpec


@dataclass(frozen=True)
class MlpOptions:
    hidden_width: int = 64
    """Width of every hidden layer."""
    num_blocks: int = 2
    """Hidden Linear + GELU blocks; each is one FSDP unit."""
    state_width: int = 40
    """The state is zero-padded (or refused if longer) to this many values."""

    def __post_init__(self) -> None:
        for key in ("hidden_width", "num_blocks", "state_width"):
            if getattr(self, key) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, key)}", key=f"model.options.{key}")


SPEC = ModelSpec(
    name="mlp",
    options=MlpOptions,
    build="tests.plugins.mlp_policy.model:build",
    collate="tests.plugins.mlp_policy.model:MlpCollate",
    token_count="tests.plugins.mlp_policy.model:samples_in",
    inference="tests.plugins.mlp_policy.model:MlpRunner",
)
