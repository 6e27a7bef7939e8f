"""The recipe's `site:` section (split from schema.py; `embodyhpc.config.schema` re-exports it): what belongs to a
cluster rather than an experiment — partition, account, container, modules, environment, secrets, templates."""

from __future__ import annotations

from dataclasses import dataclass, field

from embodyhpc.config import checks, nccl_values


@dataclass(frozen=True)
class ContainerConfig:
    image: str | None = None
    """pyxis/enroot image (srun --container-image); unset = run on the host."""
    mounts: list[str] = field(default_factory=list)
    """srun --container-mounts entries, SRC:DST[:FLAGS]."""
    workdir: str | None = None
    """srun --container-workdir."""
    extra_args: list[str] = field(default_factory=list)
    """Further srun arguments for the container (each one argument, quoted when rendered)."""


@dataclass(frozen=True)
class SiteConfig:
    name: str = "none"
    """Site profile name (informational)."""
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    """sbatch --constraint, e.g. a GPU model feature."""
    exclusive: bool = False
    """Whole nodes for training (sbatch --exclusive)."""
    gpu_request: str = "gpus-per-node"
    """How GPUs are requested: gpus-per-node, gres (--gres=gpu:N) or none."""
    modules: list[str] = field(default_factory=list)
    """Environment modules loaded before the job runs (module load ...)."""
    container: ContainerConfig = field(default_factory=ContainerConfig)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables exported in every job."""
    python: str | None = None
    """Python on the compute nodes; default: `python3` inside a container (site.container.image), else the
    interpreter that runs embodyhpc submit. Like templates_dir, container, modules, env and secrets, it chooses
    what code runs, so only a site profile may set it (not a recipe or a key=value override)."""
    templates_dir: str | None = None
    """Folder of admin-adapted sbatch templates that replace the shipped ones (same names). Templates render in
    Jinja's sandbox and include others by bare file name from this folder or the shipped ones."""
    extra_sbatch: dict[str, str] = field(default_factory=dict)
    """Further #SBATCH options for every job, e.g. {reservation: myres}. Options embodyhpc sets itself (output,
    signal, array, job-name, dependency, exclude, ...) are refused: a second #SBATCH line would silently win."""
    exclude: list[str] = field(default_factory=list)
    """Nodes no job of the chain may run on (sbatch --exclude), one node name or hostlist range per entry, e.g.
    [n3, gpu-[07-08]]: the nodes a site knows are bad. `embodyhpc resume RUN --exclude NODES` adds to it for one
    run (the node a preflight failed on prints that command)."""
    het_jobs: bool = True
    """Whether the cluster runs heterogeneous jobs (`#SBATCH hetjob` groups and one srun step over them). An RL
    run is one: a group each for actor, rollout and env, each with its own resources (rl.resources). false: one
    allocation instead, with nodes = the groups' nodes summed, every node sized for the largest group, and a
    role per rank in group order, for sites that disable heterogeneous jobs or steps."""
    secrets: list[str] = field(default_factory=list)
    """Environment variables that hold secrets (e.g. [HF_TOKEN, WANDB_API_KEY]): jobs inherit them from the
    environment `embodyhpc submit` runs in (sbatch exports it); their values are never written to resolved.yaml,
    MLflow, logs or scripts. `submit` warns about one that is not set."""

    def __post_init__(self) -> None:
        checks.choice("site.gpu_request", self.gpu_request, ("gpus-per-node", "gres", "none"))
        checks.env_names("site.env", dict(self.env))
        checks.srun_exports("site.container.extra_args", list(self.container.extra_args))
        checks.env_names("site.secrets", {name: "" for name in self.secrets})
        nccl_values.check_environment(dict(self.env), lambda name: f"site.env.{name}")
        checks.sbatch_options("site.extra_sbatch", dict(self.extra_sbatch))
        checks.node_names("site.exclude", list(self.exclude))
