"""Which device and process-group backend the training job picks from the recipe."""

from __future__ import annotations

import pytest
import torch

from embodyhpc.launch.train import device_and_backend


def test_cpu_recipes_train_on_gloo():
    assert device_and_backend(0, synthetic=False) == ("cpu", "gloo")
    assert device_and_backend(8, synthetic=True) == ("cpu", "gloo")  # the stand-in is CPU-only


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_asking_for_gpus_without_cuda_is_an_error_not_a_cpu_run():
    with pytest.raises(RuntimeError, match="resources.gpus_per_node"):
        device_and_backend(8, synthetic=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_gpu_recipes_train_on_nccl():
    assert device_and_backend(1, synthetic=False) == ("cuda", "nccl")
