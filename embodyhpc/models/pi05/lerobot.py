"""pi0.5's LeRobot exporter (the spec's `lerobot_export`): a trained model in LeRobot's pi0.5 policy layout, so that
LeRobot users can load what we train. `embodyhpc export --format lerobot` (checkpoint/lerobot_export.py) verifies
the export and calls `write` with its weights; this module knows the layout:

    <out>/model.safetensors   the weights in the published pi0.5 layout under LeRobot's "model." prefix
                              (weights.py: to_published), in the export's dtypes
    <out>/config.json         LeRobot's PI05Config fields ("type": "pi05"): chunk size and executed steps, padded
                              state/action dims, the dataset's input and output features (policy_io.json),
                              the Gemma variants of the full-size model, quantile normalisation
    <out>/policy_preprocessor.json, policy_postprocessor.json
                              LeRobot's pi0.5 processor pipelines (step names of its processor_pi05.py), whose
                              normalizer steps hold the state statistics the policy was trained with
                              (normalization.json: q01/q99 or mean/std under "observation.state") in
    <out>/policy_preprocessor_step_2_normalizer_processor.safetensors; no action statistics: our policy predicts
                              raw actions, and LeRobot passes a feature without statistics through unchanged

What stock LeRobot cannot load is refused in one line before anything is written (`loadable`): a state projection
(model.state_input other than prompt: PI05Policy has no place for one), and any size but the full one (PI05Policy
builds only PaliGemma gemma_2b with a gemma_300m expert, at fixed widths: a tiny or small model's weights fit
none of them). `strict=False` writes the layout anyway (its config then says "embodyhpc_size"), which only our
adapter reads back: the tests of the layout at a tiny size. The fields and processor steps written are those LeRobot
0.4.4 knows (PI05Config in src/lerobot/policies/pi05/configuration_pi05.py, make_pi05_pre_post_processors in
processor_pi05.py): LeRobot parses config.json and each step's config strictly, so nothing else is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from embodyhpc.errors import UserError

LEROBOT_PREFIX = "model."
WEIGHTS, CONFIG_JSON = "model.safetensors", "config.json"  # LeRobot's policy folder
VARIANTS = {"full": ("gemma_2b", "gemma_300m")}
NORM_MODES = {"quantile": "QUANTILES", "mean_std": "MEAN_STD"}
PREPROCESSOR, POSTPROCESSOR = "policy_preprocessor", "policy_postprocessor"
NORMALIZER_STEP = 2  # its place in LeRobot's pi0.5 preprocessor: rename, batch, normalize, state tokens, ...
PALIGEMMA_TOKENIZER = "google/paligemma-3b-pt-224"


def loadable(model_cfg: Any, *, strict: bool = True) -> None:
    """Refuse, in one line naming the key and why, a model stock LeRobot's PI05Policy cannot load (strict=False:
    only what the layout itself cannot hold)."""
    if model_cfg.state_input != "prompt":
        raise UserError(f"model.state_input={model_cfg.state_input} adds a state projection that pi0.5's published "
                        "layout (and LeRobot's PI05Policy) has no place for", key="model.state_input",
                        fix="export a model trained with model.state_input=prompt")
    if strict and model_cfg.size not in VARIANTS:
        paligemma, expert = VARIANTS["full"]
        raise UserError(f"model.size={model_cfg.size}: LeRobot's PI05Policy builds only pi0.5's full size (PaliGemma "
                        f"{paligemma} with a {expert} action expert, at fixed widths), which a {model_cfg.size} "
                        "model's weights do not fit", key="model.size",
                        fix="export a model trained with model.size=full; this export still runs in embodyhpc "
                            "(eval --ckpt, model.init_weights)")


def write(out_dir: Path, state: dict[str, Any], model: Any, model_cfg: Any, *, policy_io: dict[str, Any],
          normalizer: Any, execute_steps: int, strict: bool = True) -> None:
    """Write LeRobot's pi0.5 folder at `out_dir` (created here) from a verified export: its weights `state`, the
    model its recipe builds (`model`, on meta: its shape), the recipe's `model` section, the dataset's features and
    the state statistics training used (data.normalize.StateNormalizer, or None). What LeRobot cannot load is
    refused (UserError, one line) before anything is written; strict=False: only what the layout cannot hold."""
    import torch
    from safetensors.torch import save_file

    from embodyhpc.models.pi05.weights import to_published

    loadable(model_cfg, strict=strict)
    dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    published = to_published(state, model.shape, placeholders=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({LEROBOT_PREFIX + k: v for k, v in published.items()}, str(out_dir / WEIGHTS),
              metadata={"format": "pt", "layout": "lerobot-pi05"})
    dtype = "bfloat16" if dtypes == {torch.bfloat16} else "float32"
    lerobot = lerobot_config(model_cfg, policy_io, execute_steps=execute_steps, dtype=dtype)
    if normalizer is not None and normalizer.mode != "none":
        lerobot["normalization_mapping"]["STATE"] = NORM_MODES[normalizer.mode]
    (out_dir / CONFIG_JSON).write_text(json.dumps(lerobot, indent=2) + "\n")
    write_processors(out_dir, lerobot, normalizer)


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


def write_processors(out_dir: Path, config: dict[str, Any], normalizer: Any) -> None:
    """LeRobot's pi0.5 pre/post-processor pipelines for `config`, the normalizer steps holding `normalizer`'s
    (a data.normalize.StateNormalizer, or None)
    statistics (as LeRobot saves them: flat "<feature>.<stat>" tensors in a safetensors file per stateful step)."""
    import numpy as np
    from safetensors.numpy import save_file

    stats: dict[str, Any] = {}
    if normalizer is not None and normalizer.mode in NORM_MODES:
        offset, scale = np.asarray(normalizer.offset), np.asarray(normalizer.scale)
        pair = (("q01", offset - scale), ("q99", offset + scale)) if normalizer.mode == "quantile" else (
            ("mean", offset), ("std", scale))
        stats = {f"observation.state.{name}": values.astype(np.float32) for name, values in pair}
    features = {**config["input_features"], **config["output_features"]}
    norm = {"registry_name": "normalizer_processor",
            "config": {"eps": 1e-8, "features": features, "norm_map": config["normalization_mapping"]}}
    unnorm = {"registry_name": "unnormalizer_processor",
              "config": {"eps": 1e-8, "features": config["output_features"],
                         "norm_map": config["normalization_mapping"]}}
    if stats:
        norm["state_file"] = f"{PREPROCESSOR}_step_{NORMALIZER_STEP}_normalizer_processor.safetensors"
        save_file(stats, str(out_dir / norm["state_file"]))
    pre = [{"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
           {"registry_name": "to_batch_processor", "config": {}},
           norm,
           {"registry_name": "pi05_prepare_state_tokenizer_processor_step",
            "config": {"max_state_dim": config["max_state_dim"], "task_key": "task"}},
           {"registry_name": "tokenizer_processor",
            "config": {"max_length": config["tokenizer_max_length"], "task_key": "task", "padding_side": "right",
                       "padding": "max_length", "truncation": True, "tokenizer_name": PALIGEMMA_TOKENIZER}},
           {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}]
    post = [unnorm, {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}]
    assert pre[NORMALIZER_STEP] is norm
    for name, steps in ((PREPROCESSOR, pre), (POSTPROCESSOR, post)):
        (out_dir / f"{name}.json").write_text(json.dumps({"name": name, "steps": steps}, indent=2) + "\n")
