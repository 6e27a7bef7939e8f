"""The recipe schema: one dataclass per section, each handed only to the component that owns it.

Field docstrings are the reference documentation for recipe authors (`embodyhpc recipes show`
prints a resolved recipe). Invariants that concern one section live in its `__post_init__`;
invariants across sections (world size, batch arithmetic) live in `resolve.py`. Both need nothing above config:
what only the registries know (a model family's name, options, sizes and keys; suites, their tasks and options;
reference policies) and what only a dataset knows are checked by embodyhpc/validation, the one step every command
that loads a recipe goes through. The larger sections live in files of their own beside this one and are
re-exported from here: eval_schema (eval), site_schema (site), rl_schema (rl), network (network), lora_schema
(model.lora), data_mixture (data.datasets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from embodyhpc.config import checks
from embodyhpc.config.data_mixture import DatasetEntry, check_sources
from embodyhpc.config.eval_schema import EvalConfig
from embodyhpc.config.lora_schema import LoraConfig
from embodyhpc.config.network import NetworkConfig
from embodyhpc.config.rl_schema import RLConfig
from embodyhpc.config.site_schema import SiteConfig
from embodyhpc.errors import ConfigError


@dataclass(frozen=True)
class JobConfig:
    name: str = "embodyhpc"
    """Run name: the Slurm job name prefix and the run directory prefix."""
    experiment: str = "default"
    """Groups runs on disk (<runs_root>/<experiment>/) and in MLflow."""
    runs_root: str = "./runs"
    """Parallel-filesystem folder that holds run directories (site profiles set it)."""

    def __post_init__(self) -> None:
        for key in ("name", "experiment"):
            checks.path_name(f"job.{key}", getattr(self, key))
        checks.runs_root("job.runs_root", self.runs_root)


@dataclass(frozen=True)
class ResourcesConfig:
    nodes: int = 1
    """Nodes for the training job (sbatch --nodes)."""
    gpus_per_node: int = 0
    """GPUs per node; 0 trains on CPU with gloo."""
    tasks_per_node: int | None = None
    """Processes per node; default: one per GPU, or 1 without GPUs."""
    cpus_per_task: int = 1
    """CPU cores per process (data workers + the main thread)."""
    mem: str = "8G"
    """Memory per node in sbatch --mem syntax (0 = all of the node)."""
    time: str = "01:00:00"
    """Training time limit in sbatch --time syntax; the job checkpoints and requeues before it."""
    signal_delay_s: int = 120
    """Slurm sends USR2 this many seconds before the time limit (sbatch --signal)."""
    max_requeues: int = 3
    """How often a timed-out or preempted training job is requeued before giving up."""
    preflight: bool = True
    """Check each node (GPU count and ECC, RDMA ports, NVMe space, checkpoint folder) before training starts;
    a bad node fails the job at once, naming the node to --exclude. Results: logs/preflight-<node>.json."""

    def __post_init__(self) -> None:
        checks.positive("resources.nodes", self.nodes)
        checks.positive("resources.gpus_per_node", self.gpus_per_node, allow_zero=True)
        if self.tasks_per_node is not None:
            checks.positive("resources.tasks_per_node", self.tasks_per_node)
        checks.positive("resources.cpus_per_task", self.cpus_per_task)
        checks.slurm_mem("resources.mem", self.mem)
        minutes = checks.slurm_time_minutes("resources.time", self.time)
        checks.positive("resources.signal_delay_s", self.signal_delay_s, allow_zero=True)
        checks.positive("resources.max_requeues", self.max_requeues, allow_zero=True)
        if self.signal_delay_s >= minutes * 60:
            raise ConfigError(
                f"signal_delay_s={self.signal_delay_s} is not shorter than the time limit "
                f"{self.time!r}", key="resources.signal_delay_s", related=("resources.time",),
                fix="lower resources.signal_delay_s or raise resources.time")

    @property
    def procs_per_node(self) -> int:
        if self.tasks_per_node is not None:
            return self.tasks_per_node
        return max(self.gpus_per_node, 1)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def time_minutes(self) -> int:
        return checks.slurm_time_minutes("resources.time", self.time)


DATA_FORMATS = ("synthetic", "lerobot", "hdf5")
ON_BAD_SAMPLE = ("error", "skip")
IMAGE_DTYPES = ("float32", "uint8")
DECODE_DEVICES = ("cpu", "cuda", "auto")
COLLECTIVE_TIMEOUT_S = 300.0
"""How long a training rank waits in a collective (its process group and the gloo side group) before failing."""


@dataclass(frozen=True)
class DataConfig:
    format: str = "synthetic"
    """synthetic (generated in the job), lerobot (LeRobot v3.0 folder) or hdf5 (robomimic/LIBERO)."""
    root: str | None = None
    """Dataset folder on the parallel filesystem (lerobot, hdf5)."""
    datasets: list[DatasetEntry] | None = None
    """A weighted mixture instead of data.root: [{root, weight, embodiment?, delta_timestamps?, eval?}, ...]."""
    delta_timestamps: dict[str, list[float]] = field(default_factory=dict)
    """LeRobot-style {feature: [seconds, ...]}: history frames and action chunks."""
    num_workers: int = 2
    """DataLoader worker processes per rank."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead."""
    synthetic_step_s: float = 0.0
    """format synthetic only: the least seconds each step of the synthetic stand-in takes, so that a drill of
    preemption, requeue and time limits (tests, cluster bring-up) runs at a known pace on any machine; 0 runs it
    as fast as the machine goes."""
    on_bad_sample: str = "error"
    """A sample the dataset cannot read (a corrupt video frame, an unreadable HDF5 chunk): error ends the run with
    the file and episode named; skip drops it from its micro-batch, names it on the rank's log and counts it
    (metric data_skipped_samples). Failures of the recipe or the model (a collate error) always end the run."""
    batch_timeout_s: float = 120.0
    """The longest a rank waits for one micro-batch from its DataLoader workers before the run fails saying a
    worker is stuck (a hung file system, a decoder that never returns). Below COLLECTIVE_TIMEOUT_S, so that the
    stuck rank, not a peer timing out in a collective, names the reason."""
    image_dtype: str = "float32"
    """How camera frames travel from the DataLoader workers to the model. float32: LeRobot's items (C, H, W) in
    [0, 1], resized in the workers. uint8: the decoded bytes as they are: 4x less shared and pinned memory and a 4x
    smaller host-to-device copy; the conversion to float, the division by 255 and the resize run on the training
    device after the copy, in the model's input path (the batch's `to`), with the same values."""
    decode_device: str = "cpu"
    """Where video frames are decoded. cpu: FFmpeg in the DataLoader workers. cuda: torchcodec's NVDEC decoder on
    the rank's GPU, in workers started with spawn (CUDA does not survive a fork), frames copied back as uint8;
    refused where no GPU is visible. auto: cuda where a GPU and torchcodec's CUDA decoder work, else cpu."""
    gop_window_batches: int = 0
    """0 (default): micro-batches in the sampler's order. W > 0: each rank's next W micro-batches are regrouped so
    that samples of one video file and nearby frames share a micro-batch (they share seeks and decoded GOPs); every
    window, and so every epoch, draws the same samples as with 0, and resumes on any world size neither repeat nor
    skip (data/gop_order.py). It pays only where a window holds a sizeable share of the dataset (bench/data_loader.py
    with W=8 x 32: +10-20% samples/s on 900 frames, none on 9000), and micro-batches become less varied (the
    pi0.5 demo's loss after 200 steps was higher with W=8 for 5 seeds of 5): measure both before turning it on."""

    def __post_init__(self) -> None:
        checks.choice("data.format", self.format, DATA_FORMATS)
        # at most 64: wider windows regroup so much of an epoch that a micro-batch becomes a run of one episode
        if (isinstance(self.gop_window_batches, bool) or not isinstance(self.gop_window_batches, int)
                or not 0 <= self.gop_window_batches <= 64):
            raise ConfigError(f"must be a whole number of micro-batches from 0 to 64, got "
                              f"{self.gop_window_batches!r}", key="data.gop_window_batches",
                              fix="set data.gop_window_batches=0 (off) or a small window such as 8")
        if self.gop_window_batches and self.format != "lerobot":
            raise ConfigError(f"groups samples by video file, and data.format {self.format!r} has no video files",
                              key="data.gop_window_batches", related=("data.format",),
                              fix="set data.gop_window_batches=0")
        check_sources(self)  # data.root or data.datasets (config/data_mixture.py)
        checks.positive("data.num_workers", self.num_workers, allow_zero=True)
        checks.positive("data.prefetch_factor", self.prefetch_factor)
        checks.positive("data.synthetic_step_s", self.synthetic_step_s, allow_zero=True)
        checks.choice("data.on_bad_sample", self.on_bad_sample, ON_BAD_SAMPLE)
        checks.positive("data.batch_timeout_s", self.batch_timeout_s)
        checks.choice("data.image_dtype", self.image_dtype, IMAGE_DTYPES)
        checks.choice("data.decode_device", self.decode_device, DECODE_DEVICES)
        if self.batch_timeout_s >= COLLECTIVE_TIMEOUT_S:
            raise ConfigError(f"{self.batch_timeout_s:g} s is not below the {COLLECTIVE_TIMEOUT_S:g} s the other "
                              "ranks wait in a collective: they would fail first, without the stuck rank's reason",
                              key="data.batch_timeout_s",
                              fix=f"set data.batch_timeout_s below {COLLECTIVE_TIMEOUT_S:g}")
        if self.synthetic_step_s and self.format != "synthetic":
            raise ConfigError(f"paces the synthetic stand-in only, and data.format is {self.format!r}",
                              key="data.synthetic_step_s", related=("data.format",),
                              fix="remove data.synthetic_step_s (or set it to 0)")


@dataclass(frozen=True)
class StagingConfig:
    enabled: bool = False
    """Copy the dataset to node-local NVMe before training (one copier per node)."""
    nvme_dir: str = "/tmp/embodyhpc-stage"
    """Node-local scratch folder (site profiles set it)."""
    verify: str = "quick"
    """How staging checks the staged copy before training reads it. quick: hash every byte while copying, and on
    a restage re-hash only staged files whose stat (size, mtime, inode, ctime) changed; full: also re-hash
    the whole staged copy from the disk on every run (catches bit rot, costs one local read of the dataset);
    none: trust size and mtime. true/false (older recipes) mean quick/none."""
    copy_workers: int = 8
    """Parallel copy threads per node."""

    def __post_init__(self) -> None:
        checks.positive("staging.copy_workers", self.copy_workers)
        legacy = {"true": "quick", "false": "none"}
        object.__setattr__(self, "verify", legacy.get(str(self.verify).lower(), str(self.verify).lower()))
        checks.choice("staging.verify", self.verify, ("quick", "full", "none"))


ATTENTION_BACKENDS = ("auto", "flash_varlen", "torch_varlen", "flex", "sdpa_segments", "sdpa_reference")
STATE_NORMS = ("none", "mean_std", "quantile")
MODEL_FAMILY_KEYS = ("size", "attention_backend", "tokenizer_path", "max_token_len", "packing", "state_input",
                     "state_dim")
"""Keys of the model section that belong to model families, not to every model: a family reads one only where its
spec declares it (embodyhpc/models/spec.py: `sizes` for size, `keys` for the others), which also checks its value;
set for a family that does not read it (away from its default), it is refused at validate."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "pi05"
    """A registered model plug-in (embodyhpc/models/spec.py: pi05, groot, or one added by register_model or an
    `embodyhpc.models` entry point). Every model reads init_weights, action_horizon, action_dim, state_key,
    state_norm and norm_stats. The family keys (MODEL_FAMILY_KEYS: size, attention_backend, tokenizer_path,
    max_token_len, packing, state_input, state_dim) stay here, where existing recipes set them, and are read by the
    families whose spec declares them (pi0.5: all; GR00T: all but state_input and state_dim); a family refuses one
    it does not read. A new family's own options go under model.options."""
    options: dict[str, Any] = field(default_factory=dict)
    """The selected model's own options, checked against its spec's options dataclass when the recipe is loaded
    (pi0.5 takes none here)."""
    size: str = "tiny"
    """One of the family's sizes (its spec's `sizes`): pi0.5 tiny (laptop CPU), small, or full (the published
    shapes, ~3.3B parameters); groot tiny or full."""
    attention_backend: str = "auto"
    """auto picks the fastest available for the device; sdpa_reference (dense mask) is the CPU reference,
    sdpa_segments the per-sample CPU path; flex is forward-only on CPU."""
    init_weights: str | None = None
    """Step-0 weights of a fresh run: a published pi0.5 checkpoint (openpi or LeRobot: a safetensors file, a folder
    with model.safetensors, or a sharded model.safetensors.index.json) or an embodyhpc export folder. Each rank reads
    only its FSDP shard's slices. A run resuming from its own checkpoints ignores it."""
    tokenizer_path: str | None = None
    """Local SentencePiece/tokenizers file (full size); tiny/small use a byte tokenizer. Unset, a fresh run takes
    the tokenizer model.init_weights carries, if any (LeRobot's tokenizer/ folder, or a tokenizer.model /
    tokenizer.json beside the weights, as in an embodyhpc export); set, it wins over the checkpoint's. The file
    used is copied beside the checkpoints and exports, so resumed runs and evaluations read the same one."""
    action_horizon: int = 50
    """Actions predicted per chunk."""
    action_dim: int = 32
    """Action vector size (padded)."""
    max_token_len: int = 256
    """Token budget per sample (prefix + action chunk)."""
    packing: bool = True
    """Pack variable-length samples into fixed token budgets instead of padding."""
    state_key: str = "observation.state"
    """Dataset feature the policy reads as the robot state (MetaWorld demos also carry
    observation.environment_state, the simulator's full 39-d state)."""
    state_input: str = "prompt"
    """pi0.5's: prompt: the state is discretised into the prompt as text; expert: the continuous state vector is
    projected into every action-expert token (pi0-style), which learns from a few demonstrations on a CPU."""
    state_dim: int = 32
    """pi0.5's, with state_input=expert: the projection's input size (the state is zero-padded to it, like
    actions)."""
    state_norm: str = "none"
    """none, mean_std, or quantile (q01..q99 -> [-1, 1], pi0.5's choice), from the dataset's meta/stats.json; the
    statistics are saved with exported weights for evaluation."""
    norm_stats: str = "auto"
    """Where the state statistics come from: auto (those model.init_weights carries, else the dataset's), init
    (those model.init_weights carries: an error if none), dataset (meta/stats.json), or a path (an embodyhpc
    normalization.json, an openpi assets/<id>/norm_stats.json, LeRobot's policy_preprocessor.json or its normalizer
    .safetensors, or a folder holding one). A resumed run always keeps the statistics it started with
    (checkpoints/normalization.json). Checked against the dataset's state and model.state_norm before training."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Low-rank adapters on the base weights, which stay frozen (config/lora_schema.py); off unless lora.rank is set."""

    def __post_init__(self) -> None:
        # the name, options, size and family keys are the family's (models/spec.py check_model_config, at validate)
        checks.choice("model.attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        for key in ("action_horizon", "action_dim", "max_token_len"):
            checks.positive(f"model.{key}", getattr(self, key))
        checks.choice("model.state_norm", self.state_norm, STATE_NORMS)
        if not isinstance(self.norm_stats, str) or not self.norm_stats.strip():
            raise ConfigError("model.norm_stats is empty", key="model.norm_stats",
                              fix="auto, init, dataset, or the path of a statistics file")


AC_MODES = ("none", "full", "every_k")


@dataclass(frozen=True)
class ParallelismConfig:
    dp_replicate: int = 1
    """Replicas (HSDP: usually the node count on InfiniBand clusters); 1 = plain FSDP."""
    dp_shard: int = -1
    """Shard degree inside a replica; -1 = world size / dp_replicate."""
    activation_checkpointing: str = "none"
    """none, full (every block) or every_k."""
    ac_every_k: int = 2
    """With every_k: checkpoint every k-th block."""
    compile: bool = False
    """torch.compile each block (dynamic shapes: one graph per block for packed batches of any composition)."""
    cuda_graphs: bool = False
    """With compile on GPUs: replay each compiled block as a CUDA graph (inductor's reduce-overhead mode). It pays
    only where a block's parameters keep their addresses and its inputs their shapes: no FSDP2 sharding (or
    reshard_after_forward false) and fixed shapes (model.packing false). Training makes every compiled block an FSDP2
    unit freed after forward and backward (cudagraph trees re-record every step), so validate refuses true, naming
    each reason (also packing's shapes, fp8's counter); `embodyhpc smoke` counts the re-recordings on a GPU node."""

    def __post_init__(self) -> None:
        if self.cuda_graphs and not self.compile:
            raise ConfigError("CUDA graphs replay compiled blocks", key="parallelism.cuda_graphs",
                              related=("parallelism.compile",), fix="set parallelism.compile=true as well")
        checks.positive("parallelism.dp_replicate", self.dp_replicate)
        if self.dp_shard != -1:
            checks.positive("parallelism.dp_shard", self.dp_shard)
        checks.choice("parallelism.activation_checkpointing", self.activation_checkpointing, AC_MODES)
        checks.positive("parallelism.ac_every_k", self.ac_every_k)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    """Optimizer steps. `embodyhpc resume RUN train.steps=M` may raise it to train on: the warm-up + cosine is
    then stretched to M (steps after the resume follow the schedule of a run planned for M from the start, so the
    rate jumps up at the resume step)."""
    global_batch_size: int = 32
    """Samples per optimizer step over all ranks."""
    micro_batch_size: int = 8
    """Samples per rank per forward/backward; the rest is gradient accumulation."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.01
    warmup_steps: int = 100
    """Linear warm-up, then cosine decay to zero."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    seed: int = 0
    log_every: int = 10
    """Steps between metric logs."""
    ema_decay: float | None = None
    """An exponential moving average of the trainable weights, ema = d * ema + (1 - d) * weights after every
    optimizer step (fp32, sharded like the parameters, saved in checkpoints); null = none. openpi trains pi0/pi0.5
    with 0.99 (its TrainConfig default) and turns it off for LoRA; GR00T's fine-tuning keeps none. Which weights
    evaluations and exports use: eval.weights_kind."""

    def __post_init__(self) -> None:
        for key in ("steps", "global_batch_size", "micro_batch_size", "lr", "log_every"):
            checks.positive(f"train.{key}", getattr(self, key))
        for key in ("weight_decay", "warmup_steps", "grad_clip"):
            checks.positive(f"train.{key}", getattr(self, key), allow_zero=True)
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:  # NaN fails this too
            raise ConfigError(f"must lie strictly between 0 and 1, got {self.ema_decay}", key="train.ema_decay",
                              fix="set train.ema_decay=0.99 (openpi's default), or null for no EMA")


@dataclass(frozen=True)
class PrecisionConfig:
    mode: str = "bf16"
    """fp32, bf16 (mixed, fp32 reduce) or fp8 (matmuls in float8, the rest bf16)."""
    fp8_backend: str = "torchao"
    """te (transformer-engine, GPU) or torchao (also runs on CPU)."""
    fp8_recipe: str = "current"
    """Scaling for te: delayed, current or block."""

    def __post_init__(self) -> None:
        checks.choice("precision.mode", self.mode, ("fp32", "bf16", "fp8"))
        checks.choice("precision.fp8_backend", self.fp8_backend, ("torchao", "te"))
        checks.choice("precision.fp8_recipe", self.fp8_recipe, ("current", "delayed", "block"))


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = 500
    """Save a DCP checkpoint every N steps (and at the end, and on preemption)."""
    keep_latest_k: int = 3
    """Complete checkpoints kept; at least 2 (the newest may be half-written when a job dies)."""
    async_save: bool = True
    """Save in the background on a dedicated gloo group."""
    export_final: bool = True
    """Write consolidated safetensors + resolved config after training (used by evaluation)."""

    def __post_init__(self) -> None:
        checks.positive("checkpoint.every_steps", self.every_steps)
        if self.keep_latest_k < 2:
            raise ConfigError(f"keep_latest_k={self.keep_latest_k} would leave no safe "
                                     "checkpoint while the newest is being written",
                                     key="checkpoint.keep_latest_k", fix="set checkpoint.keep_latest_k=2")




TRACKING_BACKENDS = ("mlflow", "wandb")
WANDB_MODES = ("offline", "online")


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True
    """Log to MLflow (rank 0 of training, the report job)."""
    mlflow_uri: str | None = None
    """Tracking URI (site profiles set it); default: sqlite file under the runs root."""
    experiment: str | None = None
    """MLflow experiment; default: job.experiment."""
    telemetry_interval_s: float = 10.0
    """Each node samples its GPUs and host (utilisation, memory, power, temperature, throttling) into the training
    run every this many seconds; 0 turns it off."""
    backends: list[str] = field(default_factory=lambda: ["mlflow"])
    """Where runs are tracked: [mlflow] (the default and the documented dashboard), or [mlflow, wandb] to add
    Weights & Biases as a second sink with the same metric names and the evaluation videos (pip install
    'embodyhpc[track]'). MLflow keeps the run's record, so it is always listed."""
    wandb_project: str | None = None
    """W&B project; default: the MLflow experiment's name."""
    wandb_entity: str | None = None
    """W&B entity (team or user); default: the account's own."""
    wandb_mode: str = "offline"
    """offline (the default: compute nodes often have no internet; upload later with `wandb sync DIR`, the
    folder each job prints) or online (WANDB_API_KEY in site.secrets)."""

    def __post_init__(self) -> None:
        checks.positive("tracking.telemetry_interval_s", self.telemetry_interval_s, allow_zero=True)
        for name in self.backends:
            checks.choice("tracking.backends", name, TRACKING_BACKENDS)
        if len(set(self.backends)) != len(self.backends) or "mlflow" not in self.backends:
            raise ConfigError(f"{self.backends} must name mlflow once (W&B is a second sink beside it) and no "
                              "backend twice", key="tracking.backends", fix="set tracking.backends=[mlflow,wandb]")
        checks.choice("tracking.wandb_mode", self.wandb_mode, WANDB_MODES)
        for key in ("wandb_project", "wandb_entity"):
            value = getattr(self, key)
            if value is not None:
                checks.path_name(f"tracking.{key}", value)


@dataclass(frozen=True)
class Config:
    """A whole recipe after defaults, base recipes, site profile and overrides."""

    job: JobConfig = field(default_factory=JobConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    data: DataConfig = field(default_factory=DataConfig)
    staging: StagingConfig = field(default_factory=StagingConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    site: SiteConfig = field(default_factory=SiteConfig)
    rl: RLConfig = field(default_factory=RLConfig)


# Keys a site profile may set: what belongs to a cluster, not to an experiment.
SITE_KEYS = ("site", "network", "job.runs_root", "staging.nvme_dir", "tracking.mlflow_uri")
