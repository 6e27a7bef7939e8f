"""Which device and process-group backend the training job picks from the recipe, and which GPU each rank binds:
every GPU of the node visible to every task, one per task, or a share of them (partial GPU binding)."""

from __future__ import annotations

import os

import pytest
import torch

from embodyhpc.launch.distributed import from_job_environment
from embodyhpc.launch.train import device_and_backend
from embodyhpc.parallel.device import gpu_index, rank_device

# what launchers and Slurm export that decides a rank's GPU, and what the job itself exports before its process
# group (the flight recorder's dump file): every test starts without them, and leaves none behind
LAUNCHER_VARIABLES = ("CUDA_VISIBLE_DEVICES", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
                      "SLURM_GPUS_ON_NODE", "SLURM_LOCALID", "TORCH_FR_DUMP_TEMP_FILE",
                      "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


@pytest.fixture(autouse=True)
def no_launcher_environment(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.setenv(name, "")  # recorded, so that a value the job sets is removed after the test
        monkeypatch.delenv(name)


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
                                           r"fix: resources.tasks_per_node .* resources.gpus_per_node") as info:
        rank_device("cuda", 2)
    assert "\n" not in str(info.value) and cuda.events == []


# ---- partial GPU binding: Slurm shows each task a set of the node's GPUs (CUDA_VISIBLE_DEVICES) ----
def _slurm_block_binding(num_gpus: int, num_tasks: int, visible_per_task: int) -> list[list[int]]:
    """The physical GPUs Slurm shows each local rank when tasks are laid out by block and each sees
    `visible_per_task` GPUs (--gpu-bind=closest on a node of num_gpus / visible_per_task NUMA domains, or
    --gpus-per-task=1): rank r sees the r-th share of the node."""
    per_group = num_tasks // (num_gpus // visible_per_task)
    return [list(range((r // per_group) * visible_per_task, (r // per_group + 1) * visible_per_task))
            for r in range(num_tasks)]


LAYOUTS = [  # (GPUs on the node, tasks on the node, GPUs each task sees)
    (8, 8, 8),  # srun without binding, torchrun
    (8, 8, 1),  # --gpus-per-task=1 / --gpu-bind=single:1
    (8, 8, 4),  # --gpu-bind=closest on two NUMA domains of 4 GPUs
    (8, 8, 2),  # four domains of 2
    (4, 4, 2),
    (8, 4, 8),  # fewer tasks than GPUs: the first four
]


@pytest.mark.parametrize(("num_gpus", "num_tasks", "visible"), LAYOUTS, ids=[f"{g}gpus-{t}tasks-{v}visible"
                                                                               for g, t, v in LAYOUTS])
def test_every_rank_of_a_node_gets_a_gpu_of_its_own_under_slurms_binding(fake_cuda, monkeypatch, num_gpus,
                                                                         num_tasks, visible):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_GPUS", ",".join(map(str, range(num_gpus))))
    physical = []
    for local_rank, shown in enumerate(_slurm_block_binding(num_gpus, num_tasks, visible)):
        monkeypatch.setenv("SLURM_LOCALID", str(local_rank))
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(map(str, shown)))
        cuda = fake_cuda(len(shown))  # torch numbers what the task sees from 0
        device = rank_device("cuda", int(os.environ["SLURM_LOCALID"]), num_tasks)
        assert cuda.events == [("set_device", device.index)] and device.index < len(shown)
        physical.append(shown[device.index])
    assert sorted(physical) == sorted(set(physical)) and len(physical) == num_tasks  # no GPU shared


def test_the_job_environment_binds_the_slurm_task_to_its_share(fake_cuda, monkeypatch):
    """submitit reads SLURM_LOCALID; task 13 of 16 (local 5 of 8 on node 1), --gpu-bind=closest showing it GPUs
    4-7 of the node: it takes the second it sees, physical GPU 5."""
    for name, value in {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "16",
                        "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "13", "SLURM_LOCALID": "5",
                        "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
                        "CUDA_VISIBLE_DEVICES": "4,5,6,7"}.items():
        monkeypatch.setenv(name, value)
    cuda = fake_cuda(4)
    env = from_job_environment()
    assert (env.local_rank, env.local_world_size, env.hostnames) == (5, 8, ("gpu01", "gpu02"))
    assert rank_device("cuda", env.local_rank, env.local_world_size) == torch.device("cuda", 1)
    assert cuda.current == 1 and os.environ["CUDA_VISIBLE_DEVICES"].split(",")[1] == "5"


def test_under_slurm_without_gpu_ids_the_binding_is_trusted(fake_cuda, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    fake_cuda(4)
    assert [gpu_index(r, 4, 8) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_a_launcher_without_a_task_count_keeps_the_old_rule(fake_cuda, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")  # not a number: unknown
    assert gpu_index(3, 4, None) == 3 and gpu_index(3, 1, None) == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun's: 8 tasks on 4 GPUs would share
    with pytest.raises(RuntimeError, match="8 ranks share the 4 GPU"):
        gpu_index(3, 4, None)


HOSTILE = [  # (visible, local rank, local tasks, environment, message)
    (0, 0, 8, {"CUDA_VISIBLE_DEVICES": ""}, r"local rank 0 sees no GPU on .* \(CUDA_VISIBLE_DEVICES=''\) "
                                             r"\(fix: request GPUs with resources.gpus_per_node"),
    (0, 3, None, {"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, r"sees no GPU .*NoDevFiles"),
    (0, 0, 1, {}, r"sees no GPU on [^(]*\(fix:"),
    (4, 5, 8, {}, r"8 ranks share the 4 GPU\(s\) of .* \(fix: resources.tasks_per_node <= "
                  r"resources.gpus_per_node\)"),  # torchrun / local: every task sees the same 4
    (1, 5, 8, {"SLURM_JOB_ID": "1", "SLURM_JOB_GPUS": "0,1,2,3", "CUDA_VISIBLE_DEVICES": "1"},
     r"8 ranks share the 4 GPU"),  # exclusive per-task binding, but fewer GPUs than tasks
    (2, 0, 8, {"SLURM_JOB_ID": "1", "SLURM_STEP_GPUS": "0,1,2,3", "CUDA_VISIBLE_DEVICES": "0,1"},
     r"8 ranks share the 4 GPU"),
    (3, 1, 8, {"SLURM_JOB_ID": "1", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "CUDA_VISIBLE_DEVICES": "0,1,2"},
     r"sees 3 GPUs .* which 8 tasks cannot share one each \(fix: bind one GPU per task, srun --gpus-per-task=1"),
    (8, 8, 8, {}, r"local rank 8 is outside the 8 tasks of .*\(fix:"),
    (8, -1, 8, {}, r"local rank -1 is negative .*\(fix:"),
    (4, 1, 0, {}, r"local rank 1 is outside the 0 tasks"),
]


@pytest.mark.parametrize(("visible", "local_rank", "tasks", "environ", "message"), HOSTILE,
                         ids=[f"{v}visible-rank{r}-of-{t}" for v, r, t, _, _ in HOSTILE])
def test_hostile_bindings_are_one_line_errors_naming_the_fix(fake_cuda, monkeypatch, visible, local_rank, tasks,
                                                             environ, message):
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    cuda = fake_cuda(visible)
    with pytest.raises(RuntimeError, match=message) as info:
        rank_device("cuda", local_rank, tasks)
    assert "\n" not in str(info.value) and "fix:" in str(info.value) and cuda.events == []


class _Stop(Exception):
    pass


def _train_task_until_the_process_group(cuda, monkeypatch, tmp_path, *, local_rank: int) -> None:
    """train_task of rank 2 + local_rank (2 nodes x 2 tasks), down to init_process_group (a double that records in
    cuda.events and stops the job there)."""
    import torch.distributed as dist

    from embodyhpc.config.schema import Config, DataConfig, ResourcesConfig
    from embodyhpc.launch import distributed, observe
    from embodyhpc.launch import train as launch_train
    from embodyhpc.train.preempt import StopSignal

    config = Config(resources=ResourcesConfig(nodes=2, tasks_per_node=2, gpus_per_node=2),
                    data=DataConfig(format="lerobot", root=str(tmp_path)))
    env = distributed.DistEnv(rank=2 + local_rank, local_rank=local_rank, world_size=4, node_rank=1, num_nodes=2,
                              master_addr="10.0.0.1", master_port=23456, job_id="77", hostnames=("n1", "n2"))

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


def test_the_train_job_binds_its_gpu_before_the_process_group_and_binds_the_group_to_it(fake_cuda, monkeypatch,
                                                                                       tmp_path):
    cuda = fake_cuda(2)
    _train_task_until_the_process_group(cuda, monkeypatch, tmp_path, local_rank=1)
    assert cuda.events == [("set_device", 1), ("init_process_group", "nccl", torch.device("cuda", 1), 1, "1", "3")]
    assert os.environ["WORLD_SIZE"] == "4" and os.environ["MASTER_PORT"] == "23456"


def test_the_train_job_under_per_task_binding_takes_the_one_gpu_it_sees(fake_cuda, monkeypatch, tmp_path):
    """--gpus-per-task=1: local rank 1 sees only its GPU (physical 1, as cuda:0); the job's 2 tasks per node come
    from the job environment, the node's 2 GPUs from Slurm."""
    for name, value in {"SLURM_JOB_ID": "77", "SLURM_JOB_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "1"}.items():
        monkeypatch.setenv(name, value)
    cuda = fake_cuda(1)
    _train_task_until_the_process_group(cuda, monkeypatch, tmp_path, local_rank=1)
    assert cuda.events == [("set_device", 0), ("init_process_group", "nccl", torch.device("cuda", 0), 0, "1", "3")]
