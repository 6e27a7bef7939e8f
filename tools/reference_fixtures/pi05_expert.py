"""Golden fixture for pi0.5: a tiny random-initialised pi0.5 run by LeRobot 0.4.4's port (weights, inputs, outputs).

The reference is `lerobot.policies.pi05.modeling_pi05.PI05Pytorch` (LeRobot 0.4.4, a port of openpi's `PI0Pytorch`
with pi05=True). It runs on openpi's patched transformers (adaRMS in Gemma, `transformers.models.siglip.check`), so it
needs its own venv; nothing here is imported by embodyhpc. tests/models/test_reference_pi05.py loads the weights
through our published-weights adapter (embodyhpc/models/pi05/weights.py) into our Pi05Policy and compares.

Environment (Python 3.11, CPU is enough), as built for the committed fixture:

    python3.11 -m venv /work/lerobot-venv
    /work/lerobot-venv/bin/pip install lerobot==0.4.4          # torch 2.10.0, safetensors 0.8.0
    /work/lerobot-venv/bin/pip install transformers==4.53.2    # the version openpi's patch targets (its
                                                               # siglip/check.py tests for exactly 4.53.2)
    # openpi's patch (github.com/Physical-Intelligence/openpi at commit 15a9616a00943ada6c20a0f158e3adb39df2ccac,
    # README "PyTorch Support", step 3): copy its replacement files over the installed transformers
    git -C openpi archive 15a9616a src/openpi/models_pytorch/transformers_replace | tar -x -C /tmp/openpi_patch
    cp -r /tmp/openpi_patch/src/openpi/models_pytorch/transformers_replace/* \
        /work/lerobot-venv/lib/python3.11/site-packages/transformers/
    # (LeRobot's own `pi` extra pulls the same patch as a transformers git branch, which pip on PyPI cannot resolve)

Run from the repository root:

    /work/lerobot-venv/bin/python tools/reference_fixtures/pi05_expert.py

It writes tests/models/reference/pi05_expert_weights.safetensors (the reference's state dict under its own, i.e. the
published openpi/LeRobot, key names), pi05_expert_io.safetensors (inputs, fixed noise and times, outputs) and
pi05_expert.json (shapes, versions, the command). Deterministic on CPU for a given torch (seed 0).

Tiny configuration, through the reference's own classes: PI05Config with float32 and small chunk/action sizes;
`get_gemma_config` is replaced by one returning the reference's GemmaConfig at tiny sizes (the port only knows
gemma_2b/gemma_300m), and the two transformers constructors it calls get a shrunk vocabulary and SigLIP tower
(the port hard-codes vocabulary 257152, SigLIP So400m and projection_dim 2048). 8 query heads because the port
reshapes attention output to 8 * head_dim. Every parameter is then redrawn at random (the port zero-initialises the
adaRMS projections and norm scales, which would hide their layout) so each convention shows in the outputs.

Outputs: the predicted velocity of one training forward (joint prefix + action attention, captured at
action_out_proj), its elementwise loss, the gradients of its mean for a few parameters (GRAD_KEYS), and one denoised
chunk of `sample_actions` (KV cache of the prefix, Euler
from t = 1 to 0) with the velocity of every step.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

SEED = 0
OUT = Path(__file__).resolve().parents[2] / "tests" / "models" / "reference"

# tiny sizes: VLM and expert widths differ so that a stream mix-up shows
VLM = dict(width=32, depth=2, mlp_dim=48, num_heads=8, num_kv_heads=1, head_dim=8)
EXPERT = dict(width=16, depth=2, mlp_dim=24, num_heads=8, num_kv_heads=1, head_dim=8)
VISION = dict(image_size=16, patch_size=8, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=2)
VOCAB = 48
BATCH, CAMERAS, PROMPT_LENGTHS = 2, 2, (5, 3)
CHUNK, ACTION_DIM, NUM_STEPS = 4, 6, 3
TRAIN_TIME = (0.3, 0.8)
# gradients of the mean training loss recorded for these (a few KB): every part of the network, backward included
GRAD_KEYS = ("action_in_proj.weight", "time_mlp_in.weight",
             "paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.dense.weight",
             "paligemma_with_expert.gemma_expert.model.norm.dense.weight",
             "paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight",
             "paligemma_with_expert.paligemma.model.language_model.layers.1.self_attn.k_proj.weight",
             "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight",
             "paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.patch_embedding.weight")


def build_reference():
    from lerobot.policies.pi05 import modeling_pi05 as ref
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    real_paligemma, real_gemma = ref.PaliGemmaForConditionalGeneration, ref.GemmaForCausalLM

    def tiny_paligemma(config):
        config.text_config.vocab_size = VOCAB
        vision = config.vision_config
        for key, value in VISION.items():
            setattr(vision, key, value)
        vision.projection_dim = VLM["width"]
        return real_paligemma(config=config)

    def tiny_gemma(config):
        config.vocab_size = VOCAB
        return real_gemma(config=config)

    sizes = {"gemma_2b": VLM, "gemma_300m": EXPERT}
    ref.get_gemma_config = lambda variant: ref.GemmaConfig(**sizes[variant])
    ref.PaliGemmaForConditionalGeneration, ref.GemmaForCausalLM = tiny_paligemma, tiny_gemma
    config = PI05Config(dtype="float32", chunk_size=CHUNK, n_action_steps=CHUNK, max_action_dim=ACTION_DIM,
                        max_state_dim=ACTION_DIM, image_resolution=(VISION["image_size"],) * 2,
                        num_inference_steps=NUM_STEPS)
    model = ref.PI05Pytorch(config).eval()
    return ref, model


@torch.no_grad()
def randomise(model: torch.nn.Module) -> None:
    """Every parameter redrawn: matrices ~ N(0, 1/fan_in), vectors (biases, norm scales) ~ N(0, 0.2), LayerNorm
    scales around 1, so that no zero/identity initialisation hides a convention."""
    for name, p in model.named_parameters():
        if p.ndim >= 2 and "position_embedding" not in name:
            p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
        elif "layer_norm" in name or "post_layernorm" in name:
            p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
        else:
            p.normal_(0.0, 0.5 if "position_embedding" in name else 0.2)


def main() -> None:
    torch.manual_seed(SEED)
    ref, model = build_reference()
    randomise(model)
    g = torch.Generator().manual_seed(SEED + 1)
    size = VISION["image_size"]
    images = torch.rand(BATCH, CAMERAS, 3, size, size, generator=g)  # [0, 1], as our model takes them
    image_mask = torch.ones(BATCH, CAMERAS, dtype=torch.bool)
    image_mask[1, 1] = False  # sample 1 lacks its second camera
    prompt_lengths = torch.tensor(PROMPT_LENGTHS)
    prompt_ids = torch.randint(1, VOCAB, (BATCH, max(PROMPT_LENGTHS)), generator=g)
    prompt_mask = torch.arange(prompt_ids.shape[1])[None] < prompt_lengths[:, None]
    prompt_ids = prompt_ids * prompt_mask  # right padding with id 0
    actions = torch.randn(BATCH, CHUNK, ACTION_DIM, generator=g)
    train_noise = torch.randn(BATCH, CHUNK, ACTION_DIM, generator=g)
    train_time = torch.tensor(TRAIN_TIME)
    sample_noise = torch.randn(BATCH, CHUNK, ACTION_DIM, generator=g)

    # the reference takes one [B, 3, H, W] tensor per camera, pixels in [-1, 1]
    ref_images = [images[:, c] * 2.0 - 1.0 for c in range(CAMERAS)]
    ref_masks = [image_mask[:, c] for c in range(CAMERAS)]
    velocities = []
    hook = model.action_out_proj.register_forward_hook(lambda _m, _i, out: velocities.append(out.detach().clone()))
    with torch.no_grad():
        loss = model.forward(ref_images, ref_masks, prompt_ids, prompt_mask, actions, noise=train_noise,
                             time=train_time)
        train_velocity = velocities.pop()
        sampled = model.sample_actions(ref_images, ref_masks, prompt_ids, prompt_mask, noise=sample_noise,
                                       num_steps=NUM_STEPS)
    hook.remove()
    step_velocities = torch.stack(velocities)
    assert step_velocities.shape[0] == NUM_STEPS
    model.zero_grad()
    model.forward(ref_images, ref_masks, prompt_ids, prompt_mask, actions, noise=train_noise,
                  time=train_time).mean().backward()
    params = dict(model.named_parameters())
    grads = {f"grad/{key}": params[key].grad.clone() for key in GRAD_KEYS}

    from safetensors.torch import save_file

    state = {k: v.contiguous().clone() for k, v in model.state_dict().items() if not k.endswith("lm_head.weight")}
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(state, str(OUT / "pi05_expert_weights.safetensors"), metadata={"reference": ref.__name__})
    io = {"images": images, "image_mask": image_mask, "prompt_ids": prompt_ids, "prompt_lengths": prompt_lengths,
          "actions": actions, "train_noise": train_noise, "train_time": train_time, "train_velocity": train_velocity,
          "train_loss": loss, "sample_noise": sample_noise, "sampled_actions": sampled,
          "step_velocities": step_velocities, **grads}
    save_file({k: v.contiguous() for k, v in io.items()}, str(OUT / "pi05_expert_io.safetensors"))

    import lerobot
    import transformers

    meta = {"reference": f"{ref.__name__}.PI05Pytorch", "lerobot": lerobot.__version__,
            "transformers": transformers.__version__ + " + openpi transformers_replace (commit 15a9616a)",
            "torch": torch.__version__, "python": sys.version.split()[0], "seed": SEED,
            "command": "/work/lerobot-venv/bin/python tools/reference_fixtures/pi05_expert.py",
            "vlm": VLM, "expert": EXPERT, "vision": VISION, "vocab_size": VOCAB, "chunk_size": CHUNK,
            "action_dim": ACTION_DIM, "num_steps": NUM_STEPS, "dtype": "float32"}
    (OUT / "pi05_expert.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {OUT}/pi05_expert_*: {sum(v.numel() for v in state.values())} parameters")


if __name__ == "__main__":
    main()
