"""A pi0.5 checkpoint folder in the published layouts, with what each carries besides its weights (not a test module).

    lerobot_policy_folder(folder, source_model)   model.safetensors ("model." keys), config.json,
                                                  policy_preprocessor.json + its normalizer .safetensors,
                                                  tokenizer/tokenizer.model (a SentencePiece model trained here)
    openpi_folder(folder, source_model)           model.safetensors, assets/<asset id>/norm_stats.json

The statistics are made up (not the dataset's), so a test can tell which ones a run used.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

STATE_DIM = 6  # the LeRobot fixture's observation.state
CHECKPOINT_Q01 = [-3.0, -2.5, -2.0, -1.5, -1.0, -0.5]
CHECKPOINT_Q99 = [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
CHECKPOINT_MEAN = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
CHECKPOINT_STD = [1.5, 1.4, 1.3, 1.2, 1.1, 1.0]


def train_sentencepiece(path: Path, vocab_size: int = 60) -> Path:
    """A real SentencePiece model, trained on pi0.5-style prompts (ids fit the tiny model's table)."""
    import sentencepiece

    lines = [f"Task: pick up the {colour} cup number {i}, State: {i} {2 * i} {7 * i % 256};\nAction: "
             for i in range(200) for colour in ("red", "blue")]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                             model_type="unigram", pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                                             minloglevel=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.getvalue())
    return path


def lerobot_stats(**overrides) -> dict[str, np.ndarray]:
    """LeRobot's normalizer state: "<feature>.<stat>" for the state and the action (every stat its datasets have)."""
    stats = {"observation.state.q01": CHECKPOINT_Q01, "observation.state.q99": CHECKPOINT_Q99,
             "observation.state.mean": CHECKPOINT_MEAN, "observation.state.std": CHECKPOINT_STD,
             "observation.state.min": [-4.0] * STATE_DIM, "observation.state.max": [4.0] * STATE_DIM,
             "action.q01": [-1.0] * 4, "action.q99": [1.0] * 4, "action.mean": [0.0] * 4, "action.std": [0.5] * 4}
    stats.update(overrides)
    return {k: np.asarray(v, dtype=np.float32) for k, v in stats.items() if v is not None}


def preprocessor_json(state_mode: str = "QUANTILES", state_file: str = "policy_preprocessor_step_3_normalizer_processor"
                      ".safetensors", tokenizer_name: str = "tokenizer") -> dict:
    """policy_preprocessor.json as LeRobot's pi0.5 pipeline saves it (step order of processor_pi05.py)."""
    features = {"observation.state": {"type": "STATE", "shape": [STATE_DIM]},
                "observation.images.top": {"type": "VISUAL", "shape": [3, 48, 48]},
                "action": {"type": "ACTION", "shape": [4]}}
    return {"name": "policy_preprocessor", "steps": [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
        {"registry_name": "relative_actions_processor", "config": {"enabled": False}},
        {"registry_name": "normalizer_processor", "config": {
            "eps": 1e-8, "features": features,
            "norm_map": {"VISUAL": "IDENTITY", "STATE": state_mode, "ACTION": "QUANTILES"}},
         "state_file": state_file},
        {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {"max_state_dim": 32}},
        {"registry_name": "tokenizer_processor", "config": {
            "max_length": 48, "task_key": "task", "padding_side": "right", "padding": "max_length",
            "truncation": True, "tokenizer_name": tokenizer_name}},
        {"registry_name": "device_processor", "config": {"device": "cpu"}}]}


def lerobot_policy_folder(folder: Path, source=None, *, stats: dict | None = None, pipeline: dict | None = None,
                          tokenizer: bool = True) -> Path:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if source is not None:
        from embodyhpc.models.pi05.weights import save_pi05_weights

        save_pi05_weights(source, folder / "model.safetensors", key_prefix="model.")
    else:
        _no_weights(folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"type": "pi05"}))
    pipeline = pipeline if pipeline is not None else preprocessor_json()
    (folder / "policy_preprocessor.json").write_text(json.dumps(pipeline))
    save_file(stats if stats is not None else lerobot_stats(),
              str(folder / "policy_preprocessor_step_3_normalizer_processor.safetensors"))
    if tokenizer:
        train_sentencepiece(folder / "tokenizer" / "tokenizer.model")
    return folder


def _no_weights(path: Path) -> None:
    """A valid safetensors file holding no tensor: what validate's format check reads (header length + JSON header)
    for a test about the folder's other files; training would refuse it as missing every weight."""
    from safetensors.numpy import save_file

    save_file({}, str(path))


def openpi_folder(folder: Path, source=None, *, asset_ids=("physical-intelligence/libero",),
                  state: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if source is not None:
        from embodyhpc.models.pi05.weights import save_pi05_weights

        save_pi05_weights(source, folder / "model.safetensors")
    else:
        _no_weights(folder / "model.safetensors")
    entry = state if state is not None else {"mean": CHECKPOINT_MEAN, "std": CHECKPOINT_STD,
                                             "q01": CHECKPOINT_Q01, "q99": CHECKPOINT_Q99}
    for asset_id in asset_ids:
        path = folder / "assets" / asset_id / "norm_stats.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"norm_stats": {"state": entry, "actions": {"mean": [0.0] * 7, "std": [1.0] * 7,
                                                                               "q01": [-1.0] * 7, "q99": [1.0] * 7}}}))
    return folder
