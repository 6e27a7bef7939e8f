"""Golden outputs of GR00T-N1.5's flow-matching action head, from LeRobot 0.4.4's port of Isaac-GR00T's code, for
tests/models/test_reference_groot.py.

Runs in its own venv (LeRobot 0.4.4 pins torch < 2.11; never in the project's venv), from the repository root:

    python3.11 -m venv /work/lerobot-venv
    /work/lerobot-venv/bin/pip install lerobot==0.4.4 transformers==4.53.2     # diffusers comes with lerobot
    /work/lerobot-venv/bin/python tools/reference_fixtures/groot_head.py    # writes tests/models/reference/groot_head*

Made with lerobot 0.4.4, diffusers 0.35.2, torch 2.10.0 (run on CPU), transformers 4.53.2 (the port's config base
class), safetensors 0.8.0; the versions are recorded in groot_head.json. The output is byte-identical from run to run.

What it imports: only lerobot.policies.groot.action_head.{flow_matching_action_head, cross_attention_dit} (the
head and its diffusers DiT; not the Eagle backbone, which needs flash-attn). The head is built at a tiny size with
every non-size setting of nvidia/GR00T-N1.5-3B's action_head_cfg (ada_norm DiT, interleaved self-attention,
cross_attention_dim = the VLM width, final dropout, no sinusoidal positions, Beta(1.5, 1) with noise_s 0.999, 1000
timestep buckets, 4 inference steps, learned position embedding, VL LayerNorm + self-attention), random weights
(seed 0; the per-embodiment weights redrawn at std fan_in ** -0.5, every other tensor perturbed so that no norm
weight is 1 and no bias 0), in eval mode (no dropout).

It records (float32, exact inputs given to the reference):
- weights: the head's state dict under the published names (`action_head.` + the module names);
- inputs: the VLM features (backbone_features), the state (its real dims; the reference gets it zero-padded to
  max_state_dim as GR00T's processor does), the action chunk, the embodiment ids, the training noise and times,
  the sampling noise;
- outputs of `FlowmatchingActionHead.forward` (the predicted velocity, read off the action decoder by a hook, and
  the loss with a full action mask) and of `FlowmatchingActionHead.get_action` (the denoised chunk).
The noise the reference draws internally (torch.randn after a seed) is checked against the recorded one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[2] / "tests" / "models" / "reference"
SEED = 0
# the tiny size: widths of 16, two heads of 8; 4 DiT blocks (cross, self, cross, self); 2 embodiments
SIZE = dict(vlm_width=16, vl_heads=2, vl_depth=1, dit_width=16, dit_heads=2, dit_depth=4, hidden=16,
            max_state_dim=8, num_future_tokens=4, num_embodiments=2, max_seq_len=16, action_dim=4,
            action_horizon=6, num_inference_steps=4)
BATCH, VL_TOKENS, STATE_DIMS = 2, 10, 5
EMBODIMENT = [1, 0]
TIME = [0.3141, 0.9265]  # away from bucket edges: int(t * 1000) is the same in any float order


class Features(dict):
    """The port's BatchFeature as far as the head uses it: a dict whose items are also attributes."""

    def __init__(self, data: dict | None = None, **items) -> None:
        super().__init__(data or {}, **items)

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError as e:
            raise AttributeError(name) from e


def build_head():
    from lerobot.policies.groot.action_head import flow_matching_action_head as fm

    fm.BatchFeature = Features  # the output container only (transformers' BatchFeature needs no more than this)
    s = SIZE
    config = fm.FlowmatchingActionHeadConfig(
        action_dim=s["action_dim"], action_horizon=s["action_horizon"], add_pos_embed=True,
        backbone_embedding_dim=s["vlm_width"], hidden_size=s["hidden"], input_embedding_dim=s["dit_width"],
        max_action_dim=s["action_dim"], max_state_dim=s["max_state_dim"], max_num_embodiments=s["num_embodiments"],
        max_seq_len=s["max_seq_len"], model_dtype="float32", noise_beta_alpha=1.5, noise_beta_beta=1.0,
        noise_s=0.999, num_inference_timesteps=s["num_inference_steps"],
        num_target_vision_tokens=s["num_future_tokens"], num_timestep_buckets=1000, tune_diffusion_model=True,
        tune_projector=True, use_vlln=True, expand_batch=None,
        diffusion_model_cfg=dict(
            attention_head_dim=s["dit_width"] // s["dit_heads"], cross_attention_dim=s["vlm_width"], dropout=0.2,
            final_dropout=True, interleave_self_attention=True, norm_type="ada_norm",
            num_attention_heads=s["dit_heads"], num_layers=s["dit_depth"], output_dim=s["hidden"],
            positional_embeddings=None),
        vl_self_attention_cfg=dict(
            attention_head_dim=s["vlm_width"] // s["vl_heads"], dropout=0.2, final_dropout=True,
            num_attention_heads=s["vl_heads"], num_layers=s["vl_depth"], positional_embeddings=None))
    torch.manual_seed(SEED)
    head = fm.FlowmatchingActionHead(config).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith(".W"):  # category weights: 0.02 * randn at init, too small to test anything
                p.normal_(0.0, p.shape[-2] ** -0.5)
            else:
                p.add_(0.1 * torch.randn_like(p))
    return head


def main() -> int:
    import diffusers
    import lerobot
    import transformers
    from safetensors.torch import save_file

    head = build_head()
    s, g = SIZE, torch.Generator().manual_seed(SEED + 1)
    vl = torch.randn(BATCH, VL_TOKENS, s["vlm_width"], generator=g)
    state = torch.randn(BATCH, STATE_DIMS, generator=g)
    actions = torch.rand(BATCH, s["action_horizon"], s["action_dim"], generator=g) * 2 - 1
    embodiment = torch.tensor(EMBODIMENT)
    time = torch.tensor(TIME)
    padded_state = torch.nn.functional.pad(state, (0, s["max_state_dim"] - STATE_DIMS))[:, None]

    def backbone():
        return Features(backbone_features=vl.clone(), backbone_attention_mask=torch.ones(BATCH, VL_TOKENS))

    decoded, encoded = [], []
    head.action_decoder.register_forward_hook(lambda m, i, o: decoded.append(o.detach().clone()))
    head.action_encoder.register_forward_hook(lambda m, i, o: encoded.append(i[0].detach().clone()))
    head.sample_time = lambda batch_size, device, dtype: time.to(device, dtype)
    torch.manual_seed(SEED + 2)
    train_noise = torch.randn(actions.shape)
    torch.manual_seed(SEED + 2)
    with torch.no_grad():
        loss = head(backbone(), Features(state=padded_state, action=actions, embodiment_id=embodiment,
                                         action_mask=torch.ones_like(actions)))["loss"]
    t = time[:, None, None]
    torch.testing.assert_close(encoded[0], (1 - t) * train_noise + t * actions)  # the noise the head drew
    velocity = decoded[0][:, -s["action_horizon"]:]

    decoded.clear(), encoded.clear()
    torch.manual_seed(SEED + 3)
    sample_noise = torch.randn(actions.shape)
    torch.manual_seed(SEED + 3)
    sampled = head.get_action(backbone(), Features(state=padded_state, embodiment_id=embodiment))["action_pred"]
    assert len(encoded) == s["num_inference_steps"] and torch.equal(encoded[0], sample_noise)

    OUT.mkdir(parents=True, exist_ok=True)
    weights = {"action_head." + k: v.detach().contiguous() for k, v in head.state_dict().items()}
    save_file(weights, str(OUT / "groot_head.safetensors"), metadata={"format": "pt"})
    tensors = dict(vl_features=vl, state=state, actions=actions, embodiment=embodiment, time=time,
                   train_noise=train_noise, sample_noise=sample_noise, velocity=velocity, loss=loss,
                   sampled_actions=sampled)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(OUT / "groot_head_io.safetensors"))
    meta = dict(reference="lerobot.policies.groot.action_head.flow_matching_action_head.FlowmatchingActionHead",
                script="tools/reference_fixtures/groot_head.py",
                versions=dict(lerobot=lerobot.__version__, diffusers=diffusers.__version__,
                              torch=torch.__version__, transformers=transformers.__version__),
                seed=SEED, size=SIZE, batch=BATCH, vl_tokens=VL_TOKENS, state_dims=STATE_DIMS)
    (OUT / "groot_head.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {OUT}/groot_head*: {sum(v.numel() for v in weights.values())} weights, loss {loss.item():.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
