"""Which device and process-group backend the training job picks from the recipe."""

from __future__ import annotations

import os

import pytest
import torch

from embodyhpc.launch.distributed import rank_device
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


# ---- the GPU branches on CPU, with tests/cuda_doubles.py (torch 2.13's torch.cuda API) ----
def test_with_cuda_available_gpu_recipes_choose_cuda_and_nccl(fake_cuda):
    fake_cuda(8)
    assert device_and_backend(8, synthetic=False) == ("cuda", "nccl")
    assert device_and_backend(8, synthetic=True) == ("cpu", "gloo")


def test_each_local_rank_binds_its_own_gpu(fake_cuda):
    cuda = fake_cuda(4)
    assert rank_device("cuda", 3) == torch.device("cuda", 3) and cuda.current == 3
    assert rank_device(torch.device("cuda", 2), 0) == torch.device("cuda", 2) and cuda.current == 2  # explicit
    assert cuda.events == [("set_device", 3), ("set_device", 2)]
    assert rank_device("cpu", 1) == torch.device("cpu") and len(cuda.events) == 2  # a CPU rank touches no GPU


def test_a_task_that_sees_only_its_own_gpu_uses_it(fake_cuda):
    cuda = fake_cuda(1)  # Slurm's per-task binding (--gpus-per-task=1): every task sees one GPU, as index 0
    assert rank_device("cuda", 3) == torch.device("cuda", 0) and cuda.events == [("set_device", 0)]


def test_more_local_ranks_than_gpus_is_a_one_line_error_naming_the_keys(fake_cuda):
    cuda = fake_cuda(2)
    with pytest.raises(RuntimeError, match=r"local rank 2 has no GPU of its own: torch sees 2 on .*"
                                           r"resources.tasks_per_node .* resources.gpus_per_node") as info:
        rank_device("cuda", 2)
    assert "\n" not in str(info.value) and cuda.events == []


class _Stop(Exception):
    pass


def test_the_train_job_binds_its_gpu_before_the_process_group_and_binds_the_group_to_it(fake_cuda, monkeypatch,
                                                                                       tmp_path):
    """train_task, down to init_process_group (a double that records and stops the job there)."""
    import torch.distributed as dist

    from embodyhpc.config.schema import Config, DataConfig, ResourcesConfig
    from embodyhpc.launch import distributed, observe
    from embodyhpc.launch import train as launch_train
    from embodyhpc.train.preempt import StopSignal

    cuda = fake_cuda(2)
    config = Config(resources=ResourcesConfig(nodes=2, tasks_per_node=2, gpus_per_node=2),
                    data=DataConfig(format="lerobot", root=str(tmp_path)))
    env = distributed.DistEnv(rank=3, local_rank=1, world_size=4, node_rank=1, num_nodes=2, master_addr="10.0.0.1",
                              master_port=23456, job_id="77", hostnames=("n1", "n2"))

    class NoHandlers(StopSignal):  # the pytest process keeps its own signal handlers
        def install(self):
            return self

    def init_process_group(**kwargs):
        cuda.events.append(("init_process_group", kwargs["backend"], kwargs["device_id"], cuda.current,
                            os.environ["LOCAL_RANK"], os.environ["RANK"]))
        raise _Stop

    monkeypatch.setattr(launch_train, "load_resolved", lambda run_dir: config)
    monkeypatch.setattr(distributed, "from_job_environment", lambda: env)
    monkeypatch.setattr(launch_train, "StopSignal", NoHandlers)
    monkeypatch.setattr(observe, "preflight", lambda *args: None)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "stale")  # restored after the test; the job must overwrite them
    with pytest.raises(_Stop):
        launch_train.train_task(str(tmp_path))
    assert cuda.events == [("set_device", 1), ("init_process_group", "nccl", torch.device("cuda", 1), 1, "1", "3")]
    assert os.environ["WORLD_SIZE"] == "4" and os.environ["MASTER_PORT"] == "23456"
