"""The trained policy's placement: on the shard's GPU in bf16 when the shard has one (eval.gpus_per_task), on the CPU
in fp32 otherwise; the bf16 model acts like the fp32 one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embodyhpc.data.normalize import StateNormalizer
from embodyhpc.eval.trained import inference_placement, load_trained_policy
from embodyhpc.models import build_model
from embodyhpc.models.pi05.inference import Pi05Runner
from embodyhpc.validation import load_recipe
from tests.exports import make_export


def test_a_shard_with_a_gpu_runs_the_policy_there_in_bf16(fake_cuda):
    assert inference_placement(0) == ("cpu", torch.float32)
    fake_cuda(num_devices=1)
    assert inference_placement(1) == ("cuda", torch.bfloat16)
    assert inference_placement(0) == ("cpu", torch.float32)  # a CPU shard stays on the CPU where CUDA is seen


def test_asking_for_gpus_where_cuda_sees_none_is_a_runtime_failure(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"eval.gpus_per_task.*CUDA sees none.*eval.gpus_per_task=0"):
        inference_placement(1)


@pytest.fixture(scope="module")
def tiny():
    loaded = load_recipe("demo_metaworld_cpu")
    torch.manual_seed(0)
    return loaded, build_model(loaded.config.model, loaded.config.precision).float()


def observation(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {"observation.environment_state": rng.random(39, dtype=np.float32),
            "observation.images.corner": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8), "task": "reach"}


def test_the_bf16_policy_acts_like_the_fp32_one(tiny):
    loaded, model = tiny
    config = loaded.config

    def chunk(dtype):
        policy = Pi05Runner(model.to(dtype), config, normalizer=StateNormalizer(config.model.state_key, "none"),
                               execute_steps=5, denoise_steps=3, num_action_dims=4)
        policy.reset("reach-v3", 7)
        return policy.predict_chunk(observation(0))

    fp32, bf16 = chunk(torch.float32), chunk(torch.bfloat16)
    model.float()
    assert bf16.dtype == np.float32 and bf16.shape == fp32.shape == (config.model.action_horizon, 4)
    assert np.isfinite(bf16).all() and not np.array_equal(bf16, fp32)  # bf16 did run
    assert np.abs(bf16 - fp32).max() < 0.05 * max(1.0, np.abs(fp32).max())


def test_from_export_places_the_model_by_the_shards_gpus(tiny, tmp_path, monkeypatch):
    loaded, model = tiny
    export = make_export(tmp_path / "export", model, config_yaml=loaded.to_yaml())
    # the statistics training saves beside the weights (the demo recipe normalises its 39-dim state)
    StateNormalizer(loaded.config.model.state_key, "mean_std", (0.0,) * 39, (1.0,) * 39).save(export)
    policy = load_trained_policy(export, execute_steps=2, gpus=0)
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32} and policy.device.type == "cpu"
    asked = []

    def placement(gpus):  # what the GPU branch gives, kept on the CPU (nothing moves to a device here)
        asked.append(gpus)
        return "cpu", torch.bfloat16

    monkeypatch.setattr("embodyhpc.eval.trained.inference_placement", placement)
    policy = load_trained_policy(export, execute_steps=2, gpus=1)
    assert asked == [1] and {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    policy.reset("reach-v3", 0)
    assert np.isfinite(policy.act(observation(1))).all()


def test_an_env_acts_only_after_its_reset(tiny):
    loaded, model = tiny
    config = loaded.config
    policy = Pi05Runner(model, config, normalizer=StateNormalizer(config.model.state_key, "none"),
                           execute_steps=2, denoise_steps=2, num_action_dims=4)
    policy.reset("reach-v3", 3, env=1)
    with pytest.raises(RuntimeError, match=r"reset\(task, seed, env=0\)"):
        policy.act_batch([observation(0), observation(1)], [1, 0])
    with pytest.raises(ValueError, match="2 observations for 1 envs"):
        policy.act_batch([observation(0), observation(1)], [1])
    assert policy.act_batch([observation(0)], [1])[0].shape == (4,) and not policy.reads_next_observation(1)
