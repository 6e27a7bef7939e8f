"""A trained policy inside the evaluation loop, for any model plug-in: exported weights -> the spec's inference.

    policy = load_trained_policy(run_dir / "export", execute_steps=5, denoise_steps=10)
    policy.reset(task, seed)          # before every episode
    action = policy.act(obs)          # obs: the suite's observation dict (embodyhpc.eval.suites)

The export folder (embodyhpc.checkpoint.export) holds model.safetensors, config.yaml (the resolved recipe) and, when
the recipe normalised the state, normalization.json; the training job adds policy_io.json (the dataset's cameras,
image size, real action dims) and, when training read a tokenizer file, its copy (tokenizer.model or
tokenizer.json), which the policy then reads whatever the recipe's model.tokenizer_path says. Loading is the same
for every model: the weights are checked against export.json and against the model the recipe builds, then
`model_spec(config.model.name).inference` acts with them (pi0.5: embodyhpc/models/pi05/inference.py, which also
serves a batched shard: `act_batch`). The side files are checked first against export.json's hashes and then against
the recipe (eval/policy_files.py): a broken or contradicting one is one line, not NaN actions.

Placement (`inference_placement`): a shard with a GPU (eval.gpus_per_task) runs the policy there in bf16, a CPU
shard in fp32; the runner feeds the model on the device its parameters are on. Whatever the training precision, the
policy is built without fp8 layers: an fp8 run's weights are plain weights under the same names, and
transformer-engine's layers cannot even be built on a node without a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from embodyhpc.models.checkpoint_assets import TOKENIZER_FILES

__all__ = ["TOKENIZER_FILES", "inference_placement", "load_trained_policy", "with_export_tokenizer"]


def inference_placement(gpus_per_task: int) -> tuple[str, Any]:
    """(device, dtype) of the policy on a shard with `gpus_per_task` GPUs: ("cuda", bfloat16) with GPUs (the shard's
    first), ("cpu", float32) without. Asking for GPUs where CUDA sees none is a runtime failure, not a silent CPU
    run."""
    import torch

    if gpus_per_task <= 0:
        return "cpu", torch.float32
    if not torch.cuda.is_available():
        raise RuntimeError(f"the evaluation asks for {gpus_per_task} GPU(s) per shard (eval.gpus_per_task) but CUDA "
                           "sees none on this node; set eval.gpus_per_task=0 to evaluate on CPUs")
    return "cuda", torch.bfloat16


def load_trained_policy(export_dir: str | os.PathLike, *, execute_steps: int, denoise_steps: int = 10,
                        threads: int | None = None, gpus: int = 0) -> Any:
    """The model's evaluation policy over exported weights, on the shard's GPU in bf16 when `gpus`
    (eval.gpus_per_task) > 0, else on the CPU in fp32 whatever the training precision was; `.step` is the weights'
    step."""
    import torch

    from embodyhpc.checkpoint.export import load_checked_export
    from embodyhpc.eval.policy_files import check_policy_files, find_side_files
    from embodyhpc.models import build_model, model_spec

    if threads:
        torch.set_num_threads(threads)
    export_dir = Path(export_dir)
    weights, summary, config, _ = load_checked_export(export_dir)
    config = with_export_tokenizer(config, export_dir)
    model = build_model(config.model)  # inference: no fp8 layers (transformer-engine's would need a GPU to exist)
    model.load_state_dict(weights, strict=True)
    device, dtype = inference_placement(gpus)
    model.to(device=device, dtype=dtype)
    side = check_policy_files(find_side_files([export_dir]), config.model, where=str(export_dir))  # as eval --ckpt
    normalizer, dims = side.normalizer, side.action_dim or config.model.action_dim
    runner = model_spec(config.model.name).load("inference")
    policy = runner(model, config, normalizer=normalizer, execute_steps=execute_steps, denoise_steps=denoise_steps,
                    num_action_dims=dims)
    policy.step = summary.get("step")
    return policy


def with_export_tokenizer(config: Any, export_dir: Path) -> Any:
    """The recipe with model.tokenizer_path at the tokenizer copy training left beside the weights (the one it read,
    also when it came from model.init_weights rather than the recipe); unchanged when training used the built-in."""
    import dataclasses

    from embodyhpc.models.checkpoint_assets import export_tokenizer

    copy = export_tokenizer(export_dir)
    if copy is None:
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model, tokenizer_path=str(copy)))
