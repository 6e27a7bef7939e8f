"""The training step on uint8 frames (data.image_dtype=uint8) equals the step on LeRobot's float32 items: the same
images reach the model (the float items' values, converted and resized by the batch's `to()` after the copy instead
of in the workers), so the loss and every gradient agree to float tolerance. Reference: the float path, whose
conversion the dataset makes and whose resize the collate makes (both held elsewhere to LeRobot's items and to the
vision tower's own resize); the two models start from the same weights and draw the same noise and flow times.
"""

from __future__ import annotations

import copy

import pytest
import torch

from embodyhpc.config.schema import ModelConfig, PrecisionConfig
from embodyhpc.data import open_dataset
from embodyhpc.models import build_model, build_tokenizer
from embodyhpc.plugins import import_name
from embodyhpc.train.loop import micro_batch_step
from tests.train.workers import FIXTURE

INDICES = (0, 29, 30, 61, 119)  # episode starts and ends: history frames clamp, chunks pad
FAMILIES = {
    "pi05": (ModelConfig(size="tiny", action_horizon=4, action_dim=8, max_token_len=128, packing=True),
             "embodyhpc.models.pi05.batching:Pi05Collate"),
    "groot": (ModelConfig(name="groot", size="tiny", action_horizon=16, action_dim=8, max_token_len=96),
              "embodyhpc.models.groot.batching:GrootCollate"),
}


def _batches(cfg: ModelConfig, collate_path: str):
    collate = import_name(collate_path)(cfg, build_tokenizer(cfg))
    delta = {"observation.images.wrist": [-0.1, 0.0], "action": [i / 10 for i in range(cfg.action_horizon)]}
    items = {dtype: [open_dataset(FIXTURE, delta, image_dtype=dtype)[i] for i in INDICES]
             for dtype in ("float32", "uint8")}
    return collate(items["float32"]), collate(items["uint8"])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def batches(request):
    cfg, collate_path = FAMILIES[request.param]
    return cfg, *_batches(cfg, collate_path)


def test_uint8_frames_reach_the_model_as_the_float_items(batches):
    cfg, float_batch, uint8_batch = batches
    assert float_batch.images.dtype == torch.float32 and uint8_batch.images.dtype == torch.uint8
    assert uint8_batch.images.shape[-2:] == (48, 48)  # the camera's size until the device copy
    assert uint8_batch.images.element_size() * 4 == float_batch.images.element_size()  # a 4x smaller copy
    on_device = uint8_batch.to("cpu")
    assert on_device.images.dtype == torch.float32 and on_device.images.shape == float_batch.images.shape
    torch.testing.assert_close(on_device.images, float_batch.images, atol=1e-6, rtol=0)
    for name in ("actions", "action_is_pad", "state"):
        assert torch.equal(getattr(on_device, name), getattr(float_batch, name)), name


@pytest.mark.slow
def test_a_step_on_uint8_frames_equals_the_step_on_float_items(batches):
    cfg, float_batch, uint8_batch = batches
    torch.manual_seed(0)
    model = build_model(cfg)
    twin = copy.deepcopy(model)
    n = float_batch.images.shape[0]
    noise, time = torch.randn(n, cfg.action_horizon, cfg.action_dim), torch.rand(n)
    precision = PrecisionConfig(mode="fp32")
    loss_float = micro_batch_step(model, float_batch.to("cpu"), precision, noise=noise, time=time)
    loss_uint8 = micro_batch_step(twin, uint8_batch.to("cpu"), precision, noise=noise, time=time)
    torch.testing.assert_close(loss_uint8, loss_float, atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_select_keeps_the_size_uint8_images_are_resized_to():
    cfg, collate_path = FAMILIES["pi05"]
    float_batch, uint8_batch = _batches(cfg, collate_path)
    picked = uint8_batch.select([1, 3]).to("cpu")
    torch.testing.assert_close(picked.images, float_batch.select([1, 3]).images, atol=1e-6, rtol=0)
