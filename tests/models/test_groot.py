"""The tiny GR00T: training step, frozen VLM, sampling, packed == padded, sample isolation, collate refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from embodyhpc.config.schema import ModelConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_model, build_tokenizer
from embodyhpc.models.groot.batch import GrootSample, collate
from embodyhpc.models.groot.batching import GrootCollate, batch_token_budget, batch_tokens

HORIZON, ACTION_DIM = 16, 4
TEXTS = [[5, 6, 7], list(range(10, 40)), [9], list(range(50, 62)), list(range(70, 75))]


@pytest.fixture
def cfg() -> ModelConfig:
    return ModelConfig(name="groot", size="tiny", action_horizon=HORIZON, action_dim=ACTION_DIM, max_token_len=96)


@pytest.fixture
def model(cfg):
    torch.manual_seed(0)
    return build_model(cfg)


def make_batch(num_samples: int = 5, *, seed: int = 0, cameras: int = 2, with_actions: bool = True):
    g = torch.Generator().manual_seed(seed)
    samples = [GrootSample(images=torch.rand(cameras, 3, 32, 32, generator=g), text_ids=TEXTS[i % len(TEXTS)],
                           state=torch.randn(64, generator=g),
                           actions=torch.randn(HORIZON, ACTION_DIM, generator=g) if with_actions else None)
               for i in range(num_samples)]
    return collate(samples, embodiment_id=31)


def test_a_training_step_updates_only_the_action_head_when_the_vlm_is_frozen(model):
    batch = make_batch()
    out = model(batch, generator=torch.Generator().manual_seed(0))
    assert out.loss.ndim == 0 and out.per_sample_loss.shape == (5,)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is None for n, g in grads.items() if n.startswith("backbone."))
    assert all(not p.requires_grad for p in model.backbone.parameters())
    head = [n for n in grads if n.startswith("action_head.")]
    assert head and all(grads[n] is not None for n in head), [n for n in head if grads[n] is None]
    # the embodiment's category weights get gradients, the other 31 embodiments' do not
    w1 = grads["action_head.action_encoder.W1.W"]
    assert w1[31].abs().sum() > 0 and w1[:31].abs().sum() == 0


def test_tune_options_unfreeze_the_vlm(cfg):
    model = build_model(dataclasses.replace(cfg, options={"tune_llm": True, "tune_visual": True}))
    model(make_batch(2)).loss.backward()
    assert model.backbone.layers[0].mlp.up_proj.weight.grad is not None
    assert model.backbone.vision.blocks[0].fc1.weight.grad is not None


@pytest.mark.parametrize("backend", ["sdpa_reference", "sdpa_segments"])
def test_packed_rows_compute_what_per_sample_rows_compute(cfg, backend):
    """Packing changes no sample's loss nor any gradient: the LLM is causal within a sample, the VL adapter and the
    DiT's cross-attention (queries: 1 + 4 + 16 tokens per sample; keys: that sample's 32 image + n text tokens)
    see only their own sample."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg, attention_backend=backend,
                                            options={"tune_llm": True, "tune_visual": True}))
    batch = make_batch()
    noise, time = torch.randn(5, HORIZON, ACTION_DIM), torch.rand(5)
    losses, grads = [], []
    for rows in (None, [[0, 2, 4], [1, 3]], [[3, 1, 0], [4, 2]]):
        model.zero_grad()
        out = model(batch.with_rows(rows), noise=noise, time=time)
        out.loss.backward()
        losses.append(out.per_sample_loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    for loss, grad in zip(losses[1:], grads[1:], strict=True):
        torch.testing.assert_close(loss, losses[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad, grads[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa_reference", "sdpa_segments"])
def test_the_llm_is_causal_within_each_packed_sample(cfg, backend):
    """A later instruction token changes its own feature and nothing before it (the image tokens, earlier text)."""
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(cfg, attention_backend=backend))
    batch = make_batch().with_rows([[0, 1, 2], [3, 4]])
    other = dataclasses.replace(batch, text_ids=batch.text_ids.clone())
    other.text_ids[1, 29] = 300  # sample 1's last token (30 tokens)
    features = []
    for b in (batch, other):
        plan = model.plan(b)
        llm = plan.llm_layout.prepare(backend)
        with torch.no_grad():
            features.append(model.backbone(b.images, b.text_ids, plan, llm))
    changed = (features[0] - features[1]).abs().amax(-1) > 1e-6  # [R, T]
    image = 2 * model.shape.vision.num_patches
    start = image + len(TEXTS[0])  # sample 1 follows sample 0 in row 0
    assert changed[0].nonzero().flatten().tolist() == [start + image + 29]
    assert not changed[1].any()


def test_the_tiny_groot_trains_through_the_flash_seam(cfg, monkeypatch):
    """Every attention of the model (LLM causal, VL adapter, DiT cross-attention) reaches flash-attn 2.8.3's
    varlen function (tests/doubles/flash_attn) in bf16, with backward; the loss matches sdpa_reference."""
    from embodyhpc.models import attention
    from tests.helpers import DOUBLES, drop_modules

    monkeypatch.syspath_prepend(str(DOUBLES))
    drop_modules("flash_attn")
    attention._flash_attn_installed.cache_clear()
    import flash_attn

    real_reason = attention.backend_unavailable_reason
    monkeypatch.setattr(attention, "backend_unavailable_reason",
                        lambda name, device_type, dtype=None: None if name == "flash_varlen"
                        else real_reason(name, device_type, dtype))
    batch = make_batch().with_rows([[0, 2, 4], [1, 3]])
    noise, time = torch.randn(5, HORIZON, ACTION_DIM), torch.rand(5)
    losses = {}
    try:
        flash_attn.CALLS.clear()
        for backend in ("sdpa_reference", "flash_varlen"):
            torch.manual_seed(0)
            model = build_model(dataclasses.replace(cfg, options={"tune_llm": True})).to(torch.bfloat16)
            model.attention_backend = backend
            loss = model(batch, noise=noise, time=time).loss
            loss.backward()
            assert model.backbone.layers[0].self_attn.q_proj.weight.grad is not None
            losses[backend] = loss.item()
        causal = [call for call in flash_attn.CALLS if call["causal"]]
        assert len(causal) == model.shape.llm.depth  # one causal call per LLM layer
        assert len(flash_attn.CALLS) > len(causal)  # the VL adapter and cross-attention calls, not causal
    finally:
        drop_modules("flash_attn")
        attention._flash_attn_installed.cache_clear()
    assert losses["flash_varlen"] == pytest.approx(losses["sdpa_reference"], rel=3e-2)


def test_a_sample_sees_nothing_of_its_row_neighbours(model):
    batch = make_batch().with_rows([[0, 1, 2], [3, 4]])
    other = dataclasses.replace(batch, images=batch.images.clone(), text_ids=batch.text_ids.clone())
    other.images[1] = torch.rand(2, 3, 32, 32)
    other.text_ids[1, :3] = torch.tensor([100, 101, 102])
    noise, time = torch.randn(5, HORIZON, ACTION_DIM), torch.rand(5)
    a = model(batch, noise=noise, time=time).per_sample_loss
    b = model(other, noise=noise, time=time).per_sample_loss
    changed = (a - b).abs() > 1e-7
    assert changed.tolist() == [False, True, False, False, False]


def test_sampling_takes_four_euler_steps_and_is_deterministic(model):
    batch = make_batch(3, with_actions=False)
    noise = torch.randn(3, HORIZON, ACTION_DIM)
    calls = []
    velocity = model.action_head.velocity

    def recording(context, state, x, timestep, embodiment, ctx):
        calls.append(timestep.tolist())
        return velocity(context, state, x, timestep, embodiment, ctx)

    model.action_head.velocity = recording
    first = model.sample_actions(batch, noise=noise)
    assert calls == [[0.0] * 3, [250.0] * 3, [500.0] * 3, [750.0] * 3]  # t = 0, .25, .5, .75, bucketed
    assert first.shape == (3, HORIZON, ACTION_DIM) and torch.equal(first, model.sample_actions(batch, noise=noise))
    packed = model.sample_actions(batch.with_rows([[0, 1, 2]]), noise=noise)
    torch.testing.assert_close(packed, first, rtol=1e-5, atol=1e-5)


def test_loss_averages_valid_entries_per_sample(model):
    batch = make_batch(2)
    pad = torch.zeros(2, HORIZON, dtype=torch.bool)
    pad[0, 8:] = True
    dims = torch.tensor([[True, True, False, False], [True] * 4])
    masked = dataclasses.replace(batch, action_is_pad=pad, action_dim_mask=dims)
    noise, time = torch.randn(2, HORIZON, ACTION_DIM), torch.rand(2)
    model.action_head.velocity = lambda context, state, x, *rest: torch.zeros_like(x)
    loss = model(masked, noise=noise, time=time).per_sample_loss
    target = (masked.actions - noise).pow(2)
    torch.testing.assert_close(loss, torch.stack([target[0, :8, :2].mean(), target[1].mean()]))


# ---- collate, from dataset items ----
def item(cameras=("top", "wrist"), state_dims=6, horizon=HORIZON, action_dims=3, task="pick up the cup"):
    out = {f"observation.images.{c}": torch.rand(3, 48, 48) for c in cameras}
    out |= {"observation.state": torch.randn(state_dims), "action": torch.randn(horizon, action_dims),
            "action_is_pad": torch.zeros(horizon, dtype=torch.bool), "task": task}
    return out


def test_collate_packs_vlm_tokens_into_rows_of_the_budget(cfg):
    collate_fn = GrootCollate(cfg, build_tokenizer(cfg))
    batch = collate_fn([item(task="x" * n) for n in (3, 40, 10, 60, 5)])
    assert batch.images.shape == (5, 2, 3, 32, 32)  # resized to the tiny tower's 32 px
    assert batch.state.shape == (5, 64) and batch.actions.shape == (5, HORIZON, ACTION_DIM)
    assert batch.action_dim_mask[0].tolist() == [True, True, True, False]
    assert batch.embodiment.tolist() == [31] * 5
    counts = batch.token_counts(16)
    assert counts == [32 + 3, 32 + 40, 32 + 10, 32 + 60, 32 + 5]
    assert all(sum(counts[i] for i in row) <= 96 for row in batch.rows)
    assert sorted(i for row in batch.rows for i in row) == list(range(5)) and len(batch.rows) < 5
    assert batch_tokens(batch, cfg) == sum(counts) and batch_token_budget(batch, cfg) == 96 * len(batch.rows)
    # an instruction longer than the budget is cut to what max_token_len leaves after the images
    assert GrootCollate(cfg, build_tokenizer(cfg))([item(task="y" * 500)]).text_lengths.tolist() == [96 - 32]


@pytest.mark.parametrize(("bad", "match"), [
    (dict(horizon=10), r"data.delta_timestamps: the dataset's action chunk has shape \(10, 3\)"),
    (dict(action_dims=7), r"model.action_dim: the dataset has 7 action dims, more than model.action_dim=4"),
    (dict(state_dims=65), r"model.state_key: the state 'observation.state' has 65 dims"),
])
def test_collate_refuses_items_that_do_not_fit_in_one_line(cfg, bad, match):
    with pytest.raises(ConfigError, match=match) as caught:
        GrootCollate(cfg, build_tokenizer(cfg))([item(**bad)])
    assert "\n" not in str(caught.value)


def test_collate_refuses_items_without_cameras_or_state(cfg):
    collate_fn = GrootCollate(cfg, build_tokenizer(cfg))
    with pytest.raises(ValueError, match="no observation.images"):
        collate_fn([item(cameras=())])
    bad = item()
    del bad["observation.state"]
    with pytest.raises(ConfigError, match="model.state_key: the dataset has no 'observation.state'"):
        collate_fn([bad])
    with pytest.raises(ConfigError, match=r"model.max_token_len: max_token_len=39 leaves 7"):
        GrootCollate(dataclasses.replace(cfg, max_token_len=39), build_tokenizer(cfg))([item(cameras=("a", "b"))])
