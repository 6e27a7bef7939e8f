"""pi0.5 against an independent implementation: LeRobot 0.4.4's port of openpi's PyTorch pi0.5
(`lerobot.policies.pi05.modeling_pi05.PI05Pytorch`, on transformers 4.53.2 with openpi's transformers_replace patch).

The golden fixture (tests/models/reference/pi05_expert_*; made by tools/reference_fixtures/pi05_expert.py, whose
docstring has the exact command and versions) holds a tiny random-initialised reference's state dict under its own
key names (the published openpi/LeRobot layout), the inputs, fixed noise and times, and the reference's outputs. Our
model loads the weights through our published-weights adapter (models/pi05/weights.py) and must reproduce:
- the velocity and loss of a training forward (SigLIP tower, projector, Gemma prefix with (1 + w) RMSNorm and
  sqrt(width) embedding scale, the action expert's adaRMS [scale | shift | gate], the time embedding and MLP, the
  prefix/action attention mask, rotary positions counting real tokens, x_t = t * noise + (1 - t) * actions and the
  target noise - actions);
- the gradients of the mean training loss (a parameter of every part: vision, embedding, VLM and expert layers,
  adaRMS, final norm, time MLP, action projection), through our attention backends' backward;
- one denoised chunk of Euler integration from t = 1 to 0 over the cached prefix (and recomputing it);
- and saving writes the reference's tensors back under its key names (the adapter's other direction).
A missing camera and prompts of different lengths are part of the inputs; padded and packed (both samples in one
row) batches. Tolerance: 3e-6 absolute + relative (float32: summation order; measured max difference ~6e-7).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from embodyhpc.models.pi05 import Pi05Batch, Pi05Policy
from embodyhpc.models.pi05.shapes import Pi05Shape, StreamShape
from embodyhpc.models.pi05.weights import EXPERT, key_rules, load_pi05_weights, to_published, unused_published_keys
from embodyhpc.models.shapes import VisionShape

REFERENCE = Path(__file__).parent / "reference"
WEIGHTS = REFERENCE / "pi05_expert_weights.safetensors"
TOLERANCE = dict(atol=3e-6, rtol=3e-6)


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((REFERENCE / "pi05_expert.json").read_text())


@pytest.fixture(scope="module")
def io() -> dict[str, torch.Tensor]:
    return load_file(str(REFERENCE / "pi05_expert_io.safetensors"))


@pytest.fixture(scope="module")
def model(meta) -> Pi05Policy:
    vlm, expert, vision = meta["vlm"], meta["expert"], meta["vision"]
    assert vlm["num_heads"] == expert["num_heads"] and vlm["head_dim"] == expert["head_dim"]
    shape = Pi05Shape(
        vision=VisionShape(image_size=vision["image_size"], patch_size=vision["patch_size"],
                           width=vision["hidden_size"], depth=vision["num_hidden_layers"],
                           num_heads=vision["num_attention_heads"], mlp_dim=vision["intermediate_size"]),
        vlm=StreamShape(width=vlm["width"], mlp_dim=vlm["mlp_dim"]),
        expert=StreamShape(width=expert["width"], mlp_dim=expert["mlp_dim"]),
        depth=vlm["depth"], num_heads=vlm["num_heads"], num_kv_heads=vlm["num_kv_heads"], head_dim=vlm["head_dim"],
        vocab_size=meta["vocab_size"])
    policy = Pi05Policy(shape, action_horizon=meta["chunk_size"], action_dim=meta["action_dim"])
    load_pi05_weights(policy, WEIGHTS)  # strict: every reference tensor has its place, every parameter is loaded
    return policy.eval()


def _batch(io: dict[str, torch.Tensor], rows=None) -> Pi05Batch:
    return Pi05Batch(images=io["images"], prompt_ids=io["prompt_ids"], prompt_lengths=io["prompt_lengths"],
                     actions=io["actions"], image_mask=io["image_mask"], rows=rows)


ROWS = pytest.mark.parametrize("rows", [None, [[1, 0]]], ids=["padded", "packed"])


@ROWS
def test_training_velocity_and_loss_match_the_reference(model: Pi05Policy, io, rows) -> None:
    batch = _batch(io, rows)
    noise, time, actions = io["train_noise"], io["train_time"], io["actions"]
    t = time[:, None, None]
    with torch.no_grad():
        velocity = model.predict_velocity(batch, t * noise + (1 - t) * actions, time)  # openpi's x_t
        out = model(batch, noise=noise, time=time)
    torch.testing.assert_close(velocity, io["train_velocity"], **TOLERANCE)
    torch.testing.assert_close(out.per_sample_loss, io["train_loss"].mean(dim=(1, 2)), **TOLERANCE)


@ROWS
@pytest.mark.parametrize("use_kv_cache", [True, False], ids=["cached", "recomputed"])
def test_denoised_chunk_matches_the_reference(model: Pi05Policy, io, meta, rows, use_kv_cache: bool) -> None:
    sampled = model.sample_actions(_batch(io, rows), num_steps=meta["num_steps"], noise=io["sample_noise"],
                                   use_kv_cache=use_kv_cache)
    torch.testing.assert_close(sampled, io["sampled_actions"], **TOLERANCE)


def test_first_denoising_step_velocity_matches_the_reference(model: Pi05Policy, io) -> None:
    """The velocity at t = 1 over the cached prefix: the prefix/action attention of inference on its own."""
    batch = _batch(io)
    plan = model.token_plan(batch)
    with torch.no_grad():
        velocity = model.velocity_from_cache(model.prefix_cache(batch, plan), io["sample_noise"],
                                             torch.ones(batch.num_samples), plan)
    torch.testing.assert_close(velocity, io["step_velocities"][0], **TOLERANCE)


@ROWS
def test_training_gradients_match_the_reference(model: Pi05Policy, io, rows) -> None:
    expected = {k.removeprefix("grad/"): v for k, v in io.items() if k.startswith("grad/")}
    ours = {rule.theirs: rule.ours for rule in key_rules(model.shape)}
    params = dict(model.named_parameters())
    model.zero_grad(set_to_none=True)
    try:
        model(_batch(io, rows), noise=io["train_noise"], time=io["train_time"]).loss.backward()
        assert len(expected) == 8
        for key, grad in expected.items():
            if key == EXPERT + "norm.dense.weight":  # the final norm's gate rows have no branch: zero, and not ours
                grad, gate = grad.split([2 * grad.shape[0] // 3, grad.shape[0] // 3])
                assert gate.abs().max() == 0
            torch.testing.assert_close(params[ours[key]].grad, grad.reshape(params[ours[key]].shape), **TOLERANCE,
                                       msg=lambda m, key=key: f"{key}: {m}")
    finally:
        model.zero_grad(set_to_none=True)


def test_saving_writes_the_reference_tensors_under_its_names(model: Pi05Policy) -> None:
    reference = load_file(str(WEIGHTS))
    published = to_published(model.state_dict(), model.shape)
    assert set(published) == set(reference)
    placeholders = set(unused_published_keys(model.shape))  # what our model does not hold: written as zeros
    for key, tensor in published.items():
        if key in placeholders:
            assert tensor.abs().max() == 0, key
        elif key.startswith(EXPERT + "norm.dense."):  # [scale | shift] ours, the gate rows zero
            kept = 2 * tensor.shape[0] // 3
            assert torch.equal(tensor[:kept], reference[key][:kept]) and tensor[kept:].abs().max() == 0, key
        else:
            assert torch.equal(tensor, reference[key]), key
