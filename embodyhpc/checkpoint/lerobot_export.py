"""An embodyhpc export in LeRobot's pi0.5 policy layout, so that LeRobot users can load what we train.

    embodyhpc export RUN/export --out /models/my_pi05 --format lerobot

    <out>/model.safetensors   the weights in the published pi0.5 layout under LeRobot's "model." prefix
                              (models/pi05/weights.py: to_published), in the export's dtypes
    <out>/config.json         LeRobot's PI05Config fields ("type": "pi05"): chunk size and executed steps, padded
                              state/action dims, the dataset's input and output features (policy_io.json),
                              the Gemma variants of the full-size model, quantile normalisation

Only the full size has LeRobot variants (gemma_2b + gemma_300m); the config of a tiny or small export says so
("embodyhpc_size") and LeRobot's PI05Policy cannot build it, though the weights file still reads back through our
adapter. The fields written are those of lerobot's PI05Config (src/lerobot/policies/pi05/configuration_pi05.py,
read at huggingface/lerobot 0e587e5): LeRobot parses config.json strictly, so nothing else is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from embodyhpc.errors import UserError
from embodyhpc.rundir import read_policy_io

LEROBOT_PREFIX = "model."
WEIGHTS, CONFIG_JSON = "model.safetensors", "config.json"  # LeRobot's policy folder
VARIANTS = {"full": ("gemma_2b", "gemma_300m")}


def lerobot_config(model_cfg: Any, policy_io: dict[str, Any], *, execute_steps: int, dtype: str) -> dict[str, Any]:
    """config.json of LeRobot's pi05 policy for a model of `model_cfg` trained on the features of `policy_io`."""
    size = policy_io.get("image_size") or 224
    inputs: dict[str, Any] = {f"observation.images.{c}": {"type": "VISUAL", "shape": [3, size, size]}
                              for c in policy_io.get("cameras", [])}
    inputs["observation.state"] = {"type": "STATE", "shape": [model_cfg.state_dim]}
    paligemma, expert = VARIANTS.get(model_cfg.size, ("gemma_2b", "gemma_300m"))
    config = {
        "type": "pi05", "n_obs_steps": 1, "chunk_size": model_cfg.action_horizon,
        "n_action_steps": min(execute_steps, model_cfg.action_horizon),
        "max_state_dim": model_cfg.state_dim, "max_action_dim": model_cfg.action_dim,
        "input_features": inputs,
        "output_features": {"action": {"type": "ACTION", "shape": [policy_io.get("action_dim")
                                                                    or model_cfg.action_dim]}},
        "paligemma_variant": paligemma, "action_expert_variant": expert, "dtype": dtype,
        "tokenizer_max_length": model_cfg.max_token_len,
        "normalization_mapping": {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"},
    }
    if model_cfg.size not in VARIANTS:
        config["embodyhpc_size"] = model_cfg.size
    return config


def export_lerobot(export_dir: str | os.PathLike, out_dir: str | os.PathLike, *, execute_steps: int = 50) -> Path:
    """Write `out_dir` (model.safetensors + config.json) from a verified embodyhpc export; returns out_dir."""
    import torch
    from safetensors.torch import save_file

    from embodyhpc.checkpoint.export import load_checked_export
    from embodyhpc.models.pi05.weights import to_published

    export_dir, out_dir = Path(export_dir), Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise UserError(f"{out_dir} exists and is not empty", key="--out", fix="pick a new folder")
    state, _, config, meta = load_checked_export(export_dir)
    if config.model.name != "pi05":
        raise UserError(f"{export_dir} holds a {config.model.name} model; LeRobot's layout here is pi0.5's",
                        key="model.name")
    if config.model.state_input != "prompt":
        raise UserError(f"{export_dir}: model.state_input={config.model.state_input} adds a state projection that "
                        "pi0.5's published layout (and LeRobot's PI05Policy) has no place for", key="model.state_input",
                        fix="export a model trained with model.state_input=prompt")
    policy_io = read_policy_io(export_dir)
    shape = meta.shape
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    published = to_published(state, shape, placeholders=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({LEROBOT_PREFIX + k: v for k, v in published.items()}, str(out_dir / WEIGHTS),
              metadata={"format": "pt", "layout": "lerobot-pi05"})
    dtype = "bfloat16" if dtypes == {torch.bfloat16} else "float32"
    (out_dir / CONFIG_JSON).write_text(json.dumps(
        lerobot_config(config.model, policy_io, execute_steps=execute_steps, dtype=dtype), indent=2) + "\n")
    return out_dir


__all__ = ["export_lerobot", "lerobot_config"]
