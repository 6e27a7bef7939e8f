"""The tiny pi0.5: forward/backward, overfitting, packing isolates samples, cached inference, FSDP units."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embodyhpc.models.pi05 import Pi05Policy
from tests.models.conftest import ACTION_DIM, HORIZON, make_batch, make_samples


def fixed_noise_and_time(num_samples: int, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_samples, HORIZON, ACTION_DIM, generator=g), torch.rand(num_samples, generator=g)


def test_forward_backward(tiny_cfg, tiny_model: Pi05Policy) -> None:
    batch = make_batch(tiny_cfg, make_samples(3))
    out = tiny_model(batch, generator=torch.Generator().manual_seed(0))
    assert out.loss.shape == () and out.per_sample_loss.shape == (3,) and torch.isfinite(out.loss)
    out.loss.backward()
    no_grad = [name for name, p in tiny_model.named_parameters() if p.grad is None]
    assert no_grad == []  # every parameter is used: FSDP gathers nothing the step does not need
    assert all(torch.isfinite(p.grad).all() for p in tiny_model.parameters())
    nonzero = {name for name, p in tiny_model.named_parameters() if p.grad.abs().sum() > 0}
    last = len(tiny_model.layers) - 1
    assert {f"layers.{last}.vlm.k_proj.weight", f"layers.{last}.vlm.v_proj.weight",
            f"layers.{last}.vlm.attn_norm.weight", f"layers.{last}.expert.mlp_norm.modulation.weight"} <= nonzero


def test_last_layer_prefix_stream_holds_keys_and_values_only(tiny_model: Pi05Policy) -> None:
    *inner, last = tiny_model.layers
    assert {name for name, _ in last.vlm.named_parameters()} == {"attn_norm.weight", "k_proj.weight",
                                                                   "v_proj.weight"}
    assert all(hasattr(layer.vlm, "q_proj") and hasattr(layer.vlm, "mlp") for layer in inner)


def test_overfits_one_batch(tiny_cfg, tiny_model: Pi05Policy) -> None:
    """Fixed noise and times make the target a fixed regression: 30 AdamW steps cut the loss by > 10x."""
    batch = make_batch(tiny_cfg, make_samples(4))
    noise, time = fixed_noise_and_time(4)
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = tiny_model(batch, noise=noise, time=time).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 10, losses


def test_packing_gives_each_sample_the_loss_it_has_alone(tiny_cfg, tiny_model: Pi05Policy) -> None:
    samples = make_samples(4)
    samples[1] = dataclasses.replace(samples[1], image_mask=torch.tensor([True, False]))  # a missing camera
    noise, time = fixed_noise_and_time(4)
    padded = make_batch(tiny_cfg, samples)
    assert len(set(padded.prompt_lengths.tolist())) > 2  # samples of different lengths
    with torch.no_grad():
        alone = torch.cat([tiny_model(padded.select([i]), noise=noise[i:i + 1], time=time[i:i + 1]).per_sample_loss
                           for i in range(4)])
        for rows in (None, [[0, 1]], [[0, 2], [3, 1]], [[3, 1, 0, 2]]):
            batch = padded.with_rows(rows) if rows != [[0, 1]] else padded.select([0, 1]).with_rows(rows)
            got = tiny_model(batch, noise=noise[:batch.num_samples], time=time[:batch.num_samples]).per_sample_loss
            torch.testing.assert_close(got, alone[:batch.num_samples], atol=1e-5, rtol=1e-5)


def test_rows_of_uneven_stream_lengths_give_each_sample_its_loss(tiny_cfg, tiny_model: Pi05Policy) -> None:
    """The longest joint row (one long sample) holds the fewest action tokens, and the reverse: the flat streams,
    the rows of attention and their padding must still keep every sample to itself, cached inference included."""
    samples = [dataclasses.replace(s, state=s.state[:1]) for s in make_samples(4)]  # short state prompts
    samples[0] = dataclasses.replace(samples[0], instruction="pick up the cup " * 8)  # long: 2 cameras, long prompt
    for i in (1, 2, 3):  # short: one camera
        samples[i] = dataclasses.replace(samples[i], image_mask=torch.tensor([True, False]))
    noise, time = fixed_noise_and_time(4)
    padded = make_batch(tiny_cfg, samples)
    packed = padded.with_rows([[0], [1, 3], [2]])
    plan = tiny_model.token_plan(packed)
    prefix_rows, action_rows = (plan.prefix_segments != -1).sum(1), (plan.suffix_segments != -1).sum(1)
    assert prefix_rows[0] > prefix_rows[1] and action_rows[0] < action_rows[1]
    useful = sum(padded.token_counts(tiny_model.shape.vision.num_patches, HORIZON))
    flat = plan.prefix_source.shape[1] + plan.suffix_source.shape[1]
    assert useful <= flat < useful + 2 * 16  # the per-token layers compute no row padding
    with torch.no_grad():
        alone = torch.cat([tiny_model(padded.select([i]), noise=noise[i:i + 1], time=time[i:i + 1]).per_sample_loss
                           for i in range(4)])
        got = tiny_model(packed, noise=noise, time=time).per_sample_loss
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
    cached = tiny_model.sample_actions(packed, num_steps=3, generator=torch.Generator().manual_seed(1))
    full = tiny_model.sample_actions(packed, num_steps=3, generator=torch.Generator().manual_seed(1),
                                     use_kv_cache=False)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    for backend in ("sdpa_reference", "sdpa_segments"):
        tiny_model.attention_backend = backend
        with torch.no_grad():
            torch.testing.assert_close(tiny_model(packed, noise=noise, time=time).per_sample_loss, alone,
                                       atol=1e-5, rtol=1e-5)


def test_packed_and_padded_gradients_agree(tiny_cfg, tiny_model: Pi05Policy) -> None:
    padded = make_batch(tiny_cfg, make_samples(3))
    noise, time = fixed_noise_and_time(3)
    grads = []
    for batch in (padded, padded.with_rows([[2, 0], [1]])):
        tiny_model.zero_grad()
        tiny_model(batch, noise=noise, time=time).loss.backward()
        grads.append([p.grad.clone() for p in tiny_model.parameters() if p.grad is not None])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rows", [None, [[1, 2], [0]]], ids=["padded", "packed"])
def test_cached_inference_equals_recomputing_the_prefix(tiny_cfg, tiny_model: Pi05Policy, rows) -> None:
    batch = make_batch(tiny_cfg, make_samples(3, with_actions=False), rows=rows)
    cached = tiny_model.sample_actions(batch, num_steps=5, generator=torch.Generator().manual_seed(3))
    full = tiny_model.sample_actions(batch, num_steps=5, generator=torch.Generator().manual_seed(3),
                                     use_kv_cache=False)
    assert cached.shape == (3, HORIZON, ACTION_DIM)
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_sampling_is_deterministic_given_the_seed(tiny_cfg, tiny_model: Pi05Policy) -> None:
    batch = make_batch(tiny_cfg, make_samples(2, with_actions=False))
    runs = [tiny_model.sample_actions(batch, num_steps=3, generator=torch.Generator().manual_seed(seed))
            for seed in (1, 1, 2)]
    assert torch.equal(runs[0], runs[1]) and not torch.allclose(runs[0], runs[2])


def test_loss_counts_only_valid_steps_and_action_dims(tiny_cfg, tiny_model: Pi05Policy) -> None:
    samples = make_samples(2)
    samples[0] = dataclasses.replace(samples[0], action_is_pad=torch.arange(HORIZON) >= 5, num_action_dims=6)
    batch = make_batch(tiny_cfg, samples)
    noise, time = fixed_noise_and_time(2)
    with torch.no_grad():
        per_sample = tiny_model(batch, noise=noise, time=time).per_sample_loss
        t = time[:, None, None]
        velocity = tiny_model.predict_velocity(batch, t * noise + (1 - t) * batch.actions, time)
    squared = (velocity - (noise - batch.actions)).pow(2)
    torch.testing.assert_close(per_sample, torch.stack([squared[0, :5, :6].mean(), squared[1].mean()]))


def test_a_missing_camera_contributes_no_tokens(tiny_cfg, tiny_model: Pi05Policy) -> None:
    samples = make_samples(2)
    samples[0] = dataclasses.replace(samples[0], image_mask=torch.tensor([True, False]))
    batch = make_batch(tiny_cfg, samples)
    changed = dataclasses.replace(batch, images=batch.images.clone())
    changed.images[0, 1] = 0.5
    noise, time = fixed_noise_and_time(2)
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(changed, noise=noise, time=time).per_sample_loss,
                                   tiny_model(batch, noise=noise, time=time).per_sample_loss)
    counts = batch.token_counts(tiny_model.shape.vision.num_patches, HORIZON)
    assert counts[0] == 16 + int(batch.prompt_lengths[0]) + HORIZON
    assert counts[1] == 2 * 16 + int(batch.prompt_lengths[1]) + HORIZON
    # nor any vision work: the tower encodes the 3 present images, not 4 slots, and the missing one gets no gradient
    encoded = []
    hook = tiny_model.vision.register_forward_hook(lambda module, args, out: encoded.append(args[0].shape[0]))
    images = batch.images.clone().requires_grad_(True)
    try:
        tiny_model(dataclasses.replace(batch, images=images), noise=noise, time=time).loss.backward()
    finally:
        hook.remove()
        tiny_model.zero_grad(set_to_none=True)
    assert encoded == [3]
    assert images.grad[0, 1].abs().sum() == 0 and images.grad[0, 0].abs().sum() > 0


def test_attention_backends_agree_inside_the_model(tiny_cfg, tiny_model: Pi05Policy) -> None:
    batch = make_batch(tiny_cfg, make_samples(3), rows=[[0, 2], [1]])
    noise, time = fixed_noise_and_time(3)
    results = []
    for backend in ("sdpa_reference", "sdpa_segments"):
        tiny_model.attention_backend = backend
        tiny_model.zero_grad()
        out = tiny_model(batch, noise=noise, time=time)
        out.loss.backward()
        results.append((out.per_sample_loss.detach(), [p.grad.clone() for p in tiny_model.parameters()
                                                        if p.grad is not None]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_images_of_another_size_are_resized(tiny_cfg, tiny_model: Pi05Policy) -> None:
    batch = make_batch(tiny_cfg, make_samples(1, image_size=48))
    assert torch.isfinite(tiny_model(batch).loss)


def test_fsdp_units_partition_the_blocks(tiny_model: Pi05Policy) -> None:
    units = tiny_model.fsdp_units()
    assert units[0] is tiny_model.embed_tokens
    assert units[1:] == [*tiny_model.vision.blocks, *tiny_model.layers]
    unit_params = [{id(p) for p in unit.parameters()} for unit in units]
    assert sum(len(u) for u in unit_params) == len(set().union(*unit_params))  # no parameter in two units
    in_units = sum(p.numel() for unit in units for p in unit.parameters())
    assert in_units / sum(p.numel() for p in tiny_model.parameters()) > 0.9  # the root keeps only small parts


def test_meta_build_then_materialise(tiny_cfg) -> None:
    from embodyhpc.models import build_model

    with torch.device("meta"):
        model = build_model(tiny_cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert torch.isfinite(model(make_batch(tiny_cfg, make_samples(2))).loss)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_varlen", "torch_varlen", "flex"])
def test_gpu_backends_inside_the_model(tiny_cfg, backend: str) -> None:
    from embodyhpc.models.attention import backend_unavailable_reason

    reason = backend_unavailable_reason(backend, "cuda", torch.bfloat16)
    assert reason is None, reason  # on a GPU node a missing kernel library fails (tests/conftest.py's gpu policy)
    from embodyhpc.models import build_model

    torch.manual_seed(0)
    model = build_model(tiny_cfg).cuda()
    batch = make_batch(tiny_cfg, make_samples(4), rows=[[0, 2], [3, 1]]).to("cuda")
    noise, time = (t.cuda() for t in fixed_noise_and_time(4))
    losses = {}
    for name in ("sdpa_reference", backend):
        model.attention_backend = name
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses[name] = model(batch, noise=noise, time=time).per_sample_loss.float()
        losses[name].sum().backward()
    torch.testing.assert_close(losses[backend], losses["sdpa_reference"], atol=2e-2, rtol=2e-2)
    cached = model.sample_actions(batch, num_steps=3, generator=torch.Generator("cuda").manual_seed(0))
    assert torch.isfinite(cached).all()
