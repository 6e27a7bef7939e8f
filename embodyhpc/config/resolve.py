"""resolve(): the one place where parallelism degrees and batch sizes meet the world size."""

from __future__ import annotations

from dataclasses import dataclass

from embodyhpc.config import limits, nccl_values
from embodyhpc.config.checks import slurm_time_minutes
from embodyhpc.config.schema import Config
from embodyhpc.errors import ConfigError

# keys that decide the world size: a conflict is blamed on whichever layer set one of them last
_WORLD_KEYS = ("resources.nodes", "resources.tasks_per_node", "resources.gpus_per_node")
_DP_KEYS = ("parallelism.dp_replicate", "parallelism.dp_shard")
_SQLITE_UNSAFE = "'\"?#\\"


@dataclass(frozen=True)
class Resolved:
    world_size: int
    procs_per_node: int
    dp_replicate: int
    dp_shard: int
    grad_accum_steps: int
    train_time_min: int
    eval_time_min: int
    num_eval_episodes: int


def resolve(config: Config) -> Resolved:
    limits.check(config)  # first: an absurd node count is named as such, not as a batch that does not divide
    res, par, train = config.resources, config.parallelism, config.train
    world = res.world_size
    degrees = (f"world_size={world} (resources.nodes={res.nodes} x {res.procs_per_node} per node), "
               f"parallelism.dp_replicate={par.dp_replicate}, parallelism.dp_shard={par.dp_shard}")
    if world % par.dp_replicate:
        raise ConfigError(f"world size is not divisible by dp_replicate: {degrees}",
                          key="parallelism.dp_replicate", related=_WORLD_KEYS,
                          fix="make dp_replicate divide the world size")
    dp_shard = world // par.dp_replicate if par.dp_shard == -1 else par.dp_shard
    if par.dp_replicate * dp_shard != world:
        raise ConfigError(f"dp_replicate x dp_shard must equal the world size: {degrees}",
                          key="parallelism.dp_shard", related=_WORLD_KEYS + _DP_KEYS,
                          fix="set parallelism.dp_shard=-1 to fill the world")
    data_parallel = par.dp_replicate * dp_shard
    per_step = train.micro_batch_size * data_parallel
    if train.global_batch_size % per_step:
        raise ConfigError(
            f"global_batch_size={train.global_batch_size} is not a multiple of micro_batch_size="
            f"{train.micro_batch_size} x data-parallel ranks={data_parallel} ({degrees})",
            key="train.global_batch_size", related=(*_WORLD_KEYS, *_DP_KEYS, "train.micro_batch_size"),
            fix=f"use a multiple of {per_step}")
    precision = config.precision
    if precision.mode == "fp8" and precision.fp8_backend == "te" and res.gpus_per_node == 0:
        raise ConfigError("fp8 with transformer-engine needs GPUs (resources.gpus_per_node=0)",
                          key="precision.fp8_backend", related=("precision.mode", "resources.gpus_per_node"),
                          fix="set precision.fp8_backend=torchao for CPU runs")
    if precision.mode == "fp8" and precision.fp8_backend == "te" and config.parallelism.compile:
        # transformer-engine disables dynamo in te.Linear.forward (@no_torch_dynamo) and in its checkpoint
        # (@torch._disable_dynamo): a compiled block graph-breaks at every te.Linear, an activation-checkpointed one
        # runs wholly eagerly. The compile would cost its warm-up and gain nothing.
        raise ConfigError("torch.compile gains nothing with transformer-engine: te.Linear and TE's activation "
                          "checkpoint disable dynamo, so compiled blocks run eagerly", key="parallelism.compile",
                          related=("precision.fp8_backend",),
                          fix="set parallelism.compile=false (and cuda_graphs=false), or precision.fp8_backend=torchao "
                          "to compile fp8 blocks")
    if config.parallelism.cuda_graphs and res.gpus_per_node == 0:
        raise ConfigError("CUDA graphs need GPUs (resources.gpus_per_node=0)", key="parallelism.cuda_graphs",
                          related=("resources.gpus_per_node",), fix="set parallelism.cuda_graphs=false for CPU runs")
    if config.parallelism.cuda_graphs:
        _refuse_cuda_graphs(config)
    if config.staging.enabled and config.data.format == "synthetic":
        raise ConfigError("staging needs a dataset on disk, but data.format is synthetic",
                          key="staging.enabled", related=("data.format",),
                          fix="set data.format and data.root, or staging.enabled=false")
    tracking, runs_root = config.tracking, config.job.runs_root
    unsafe = sorted({c for c in runs_root if c in _SQLITE_UNSAFE})
    if tracking.enabled and not tracking.mlflow_uri and unsafe:
        # the default store is sqlite:///<runs_root>/mlflow.db: these characters end the path in a URI or break
        # MLflow's SQL; refused here rather than tracking silently turning off after a traceback at submit
        raise ConfigError(f"contains {' '.join(unsafe)}, which the default MLflow store (sqlite:///<runs_root>/"
                          "mlflow.db) cannot hold", key="job.runs_root",  # the folder's name is at fault
                          fix="use a folder without these characters, or set tracking.mlflow_uri "
                              "(or tracking.enabled=false)")
    _check_job_environment(config)
    ev = config.eval
    return Resolved(
        world_size=world,
        procs_per_node=res.procs_per_node,
        dp_replicate=par.dp_replicate,
        dp_shard=dp_shard,
        grad_accum_steps=train.global_batch_size // per_step,
        train_time_min=res.time_minutes,
        eval_time_min=slurm_time_minutes("eval.time", ev.time),
        num_eval_episodes=len(ev.tasks) * len(ev.seeds) * ev.episodes_per_task,
    )


def _check_job_environment(config: Config) -> None:
    """site.env and the network profile are each checked on their own; a training job sees both (the profile
    wins a name both set), so pairs split between them are checked here."""
    network_env = config.network.environment()
    nccl_values.check_environment({**config.site.env, **network_env},
                                  lambda name: config.network.key_of(name) if name in network_env
                                  else f"site.env.{name}")


def _refuse_cuda_graphs(config: Config) -> None:
    """CUDA graphs of compiled blocks cannot pay in FSDP2 training, so `cuda_graphs: true` is refused with every
    reason that applies. Cudagraph trees replay a graph only while its parameters keep their addresses and its
    inputs their shapes. parallelize() makes every compiled block an FSDP2 unit, and FSDP2 frees a unit's gathered
    parameters after forward (reshard_after_forward: every unit but the last) and after backward (every unit, on any
    dp_shard, 1 included) and gathers them into new memory next time: a new address, a new recording, every step."""
    reasons = ["FSDP2 frees each compiled block's gathered parameters after forward (reshard_after_forward) and "
               "backward, so they come back at new addresses and cudagraph trees re-record every step"]
    related = ["parallelism.compile", "parallelism.dp_shard"]
    if config.model.packing:
        reasons.append("model.packing changes the blocks' input shapes almost every step (one recording per shape)")
        related.append("model.packing")
    if config.precision.mode == "fp8":
        reasons.append("the fp8 GEMM counter adds in place to a tensor cudagraphs do not manage, so they skip the "
                       "fp8 blocks")
        related.append("precision.mode")
    raise ConfigError(f"CUDA graphs cannot pay here: {'; '.join(reasons)}", key="parallelism.cuda_graphs",
                      related=tuple(related),
                      fix="set parallelism.cuda_graphs=false (parallelism.compile keeps the fused kernels); "
                          "`embodyhpc smoke` counts the re-recordings on a GPU node")
