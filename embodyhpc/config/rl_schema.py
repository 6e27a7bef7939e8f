"""The `rl:` section: reinforcement learning of a policy in simulation (issue 31; the design in embodyhpc/rl).

An RL run replaces the training job with one RL job of three roles (actor: FSDP2 ranks that train the policy;
rollout: workers that sample action chunks with Flow-SDE; env: workers that step the simulators), then evaluates
and reports like a training run. `rl.enabled: false` (the default) leaves every other recipe as it was.

Keys of other sections an RL run reads: train.lr (the policy's learning rate), train.seed, train.global_batch_size
(asynchronous: the admitted chunk samples per optimizer step of the actor, over all actor ranks), checkpoint.*
(the actor saves <run>/checkpoints/step-<version> like training), model.init_weights (the supervised policy RL
starts from: required), eval.suite and eval.tasks (where it trains; held-out evaluation keeps eval.seeds, which
must differ from rl.train_seeds). The checks that involve those sections are embodyhpc/validation/rl_checks.py's;
the ones below need only this section.

The recipe key `rl.async` is the field `async_` here (`async` is a Python keyword); config/load.py maps the two.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from embodyhpc.config import checks
from embodyhpc.errors import ConfigError

ALGORITHMS = ("grpo", "ppo")
ROLES = ("actor", "rollout", "env")
MAX_SEED = 2**31 - 1  # simulators take 32-bit seeds (as eval.seeds)
_PARTITION_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.,-]*$")

# key: (least, most, why the most). Bounds far past real use, so that a slip (an extra zero, a negative, 1e9) is
# one line here and not a job that allocates absurdly, waits forever, or has an unbounded queue.
INT_BOUNDS: dict[str, tuple[int, int, str]] = {
    "group_size": (1, 4096, "more rollouts per initial state than any GRPO setting uses"),
    "envs_per_worker": (1, 1024, "more environments than one worker process steps"),
    "env_workers": (1, 4096, "more env worker processes per node than any node runs"),
    "rollout_workers": (1, 100_000, "more rollout workers than any cluster has GPUs"),
    "actor_ranks": (1, 100_000, "more actor ranks than any cluster has GPUs"),
    "iterations": (1, 1_000_000_000, "more policy versions than any run produces"),
    "episodes_per_iteration": (1, 10_000_000, "more episodes per version than any run collects"),
    "micro_batch_size": (1, 1_048_576, "more samples per rank than any device holds"),
    "denoise_steps": (1, 1000, "more denoising steps than a flow policy samples with (each is a log-prob factor)"),
    "execute_steps": (1, 10_000, "more actions per chunk than any policy predicts"),
    "max_episode_steps": (1, 100_000_000, "longer episodes than any simulator runs"),
    "max_staleness": (0, 1_000_000, "older samples than any off-policy correction holds"),
    "queue_depth": (1, 1_000_000, "more messages per queue than memory holds (0 would mean no bound at all)"),
}
# key: (least, most, least included, most included, the fix)
FLOAT_BOUNDS: dict[str, tuple[float, float, bool, bool, str]] = {
    "noise_level": (0.0, 10.0, True, True, "0 (deterministic) .. 10; pi-RL's flow-SDE uses about 0.5"),
    "clip_eps": (0.0, 1.0, False, False, "a ratio clip between 0 and 1, e.g. 0.2"),
    "behav_cap": (1.0, 1e6, True, True, "a cap of at least 1 (an importance weight of 1 is on-policy), e.g. 2"),
    "gamma": (0.0, 1.0, False, True, "a discount in (0, 1], e.g. 0.99"),
    "gae_lambda": (0.0, 1.0, True, True, "a GAE lambda in [0, 1], e.g. 0.95"),
    "value_lr": (0.0, 1.0, False, True, "a learning rate in (0, 1], e.g. 1e-4"),
    "peer_timeout_s": (1.0, 86_400.0, True, True, "1 .. 86400 seconds, e.g. 120: every wait on a peer is bounded"),
    "straggler_delay_s": (0.0, 60.0, True, True, "0 .. 60 seconds (a benchmark's deliberately slow env worker)"),
}
ROLE_BOUNDS: dict[str, tuple[int, int]] = {
    "nodes": (1, 1_000_000), "tasks_per_node": (1, 1024), "cpus_per_task": (1, 4096), "gpus_per_node": (0, 64),
}


def bounded_int(key: str, value: int, least: int, most: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"wrong type: expected an integer, got {value!r}", key=key)
    if value < least:
        raise ConfigError(f"must be >= {least}, got {value}", key=key, fix=f"set {key} to {least} or more")
    if value > most:
        raise ConfigError(f"{value} is {why or 'past what any run uses'} (at most {most})", key=key,
                          fix=f"set {key} to at most {most}")


def bounded_float(key: str, value: float, bounds: tuple[float, float, bool, bool, str]) -> None:
    least, most, with_least, with_most, fix = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"must be a finite number, got {value!r}", key=key, fix=f"use {fix}")
    low_ok = value >= least if with_least else value > least
    high_ok = value <= most if with_most else value < most
    if not (low_ok and high_ok):
        interval = f"{'[' if with_least else '('}{least:g}, {most:g}{']' if with_most else ')'}"
        raise ConfigError(f"{value:g} is outside {interval}", key=key, fix=f"use {fix}")


@dataclass(frozen=True)
class RoleResources:
    """What one role's group of the heterogeneous job asks for (one `#SBATCH hetjob` component)."""

    nodes: int = 1
    """Nodes of this group."""
    tasks_per_node: int | None = None
    """Processes per node; default: the role's processes (rl.actor_ranks, rl.rollout_workers) spread evenly over
    the group's nodes; for env, rl.env_workers per node. Set, it must agree with them."""
    cpus_per_task: int = 1
    """CPU cores per process (an env worker steps rl.envs_per_worker simulators on them)."""
    mem: str = "8G"
    """Memory per node in sbatch --mem syntax (0 = all of the node)."""
    gpus_per_node: int = 0
    """GPUs per node (requested in the site's style, site.gpu_request); 0: the role runs on CPUs (gloo)."""
    partition: str | None = None
    """This group's partition (e.g. a CPU partition for env workers); default: site.partition."""

    def check(self, prefix: str) -> None:
        for key, (least, most) in ROLE_BOUNDS.items():
            value = getattr(self, key)
            if value is not None:
                bounded_int(f"{prefix}.{key}", value, least, most)
        checks.slurm_mem(f"{prefix}.mem", self.mem)
        if self.partition is not None and not _PARTITION_RE.match(self.partition):
            raise ConfigError(f"{self.partition!r} is not a Slurm partition name", key=f"{prefix}.partition",
                              fix="name a partition `sinfo` lists, e.g. cpu, or remove the key")


@dataclass(frozen=True)
class RLResources:
    """The heterogeneous job's groups, in the order Slurm gets them: actor, rollout, env. The job's time limit,
    signal delay and requeues are resources.time, resources.signal_delay_s and resources.max_requeues."""

    actor: RoleResources = field(default_factory=RoleResources)
    """The FSDP2 ranks that train the policy (GPU nodes on a cluster)."""
    rollout: RoleResources = field(default_factory=RoleResources)
    """The workers that sample action chunks (inference GPUs on a cluster)."""
    env: RoleResources = field(default_factory=RoleResources)
    """The workers that step the simulators (CPU or render nodes)."""


@dataclass(frozen=True)
class RoleGroup:
    """One role's group as the job runs it (RLConfig.group): tasks_per_node resolved, `tasks` = all its processes."""

    role: str
    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    mem: str
    gpus_per_node: int
    partition: str | None

    @property
    def tasks(self) -> int:
        return self.nodes * self.tasks_per_node


@dataclass(frozen=True)
class RLConfig:
    enabled: bool = False
    """true makes the run an RL run: its chain is rl -> eval -> report (no train job), starting from
    model.init_weights."""
    algorithm: str = "grpo"
    """grpo: a group of rl.group_size rollouts per initial state, the success reward normalised within the group,
    no critic; ppo: a value head (rl.value_lr) and GAE (rl.gamma, rl.gae_lambda)."""
    async_: bool = False
    """Recipe key `rl.async`. false: the synchronous baseline (env steps with rollout, then the actor trains, then
    the weights go to the rollout workers); true: the three asynchronous levels of RL-VLA3 (env stepping overlaps
    rollout inference, rollouts stream to the actor in pieces, the actor trains on micro-batches as they arrive),
    samples admitted up to rl.max_staleness versions old, the off-policy gap corrected (rl.behav_cap). Needs
    rl.max_staleness >= 1: with 0 every sample in flight when the weights change is discarded, and the pipeline
    degenerates into a slower synchronous one."""
    group_size: int = 8
    """GRPO: rollouts per initial state (task, seed, episode); at least 2 (a group of one has no baseline), and it
    divides rl.episodes_per_iteration."""
    envs_per_worker: int = 4
    """Simulators each env worker steps."""
    env_workers: int = 1
    """Env worker processes per node of the env group (rl.resources.env.nodes x this in all)."""
    rollout_workers: int = 1
    """Rollout worker processes in all (over rl.resources.rollout.nodes)."""
    actor_ranks: int = 1
    """FSDP2 ranks of the actor in all (over rl.resources.actor.nodes)."""
    iterations: int = 20
    """Policy versions to produce: optimizer steps of the actor (the checkpoints' step numbers)."""
    episodes_per_iteration: int = 32
    """Synchronous: episodes per round, whose chunk samples make one optimizer step (one version); asynchronous:
    the actor steps whenever train.global_batch_size chunk samples are admitted."""
    micro_batch_size: int = 32
    """Chunk samples per actor rank per forward/backward, gradients accumulated over a step's micro-batches;
    train.global_batch_size is a multiple of it x rl.actor_ranks (whole micro-batches on every rank)."""
    denoise_steps: int = 4
    """K: Flow-SDE denoising steps per action chunk while sampling for training (evaluation keeps
    eval.denoise_steps and the deterministic ODE)."""
    noise_level: float = 0.5
    """Flow-SDE's noise level a (sigma_t = a * sqrt(t / (1 - t))): exploration while sampling; 0 samples the ODE."""
    execute_steps: int = 5
    """Actions of a chunk the env executes before the policy observes again (at most model.action_horizon)."""
    max_episode_steps: int = 100
    """Env steps before an episode ends unsuccessful."""
    clip_eps: float = 0.2
    """PPO ratio clip, in (0, 1)."""
    behav_cap: float = 2.0
    """Cap of the behaviour importance weight (decoupled PPO) or of the truncated importance weight (GRPO, async),
    at least 1."""
    max_staleness: int = 1
    """The oldest sample the actor admits, in policy versions behind its own; older ones are dropped and counted
    (rl/rejected_stale_fraction)."""
    gamma: float = 0.99
    """PPO: discount, in (0, 1]."""
    gae_lambda: float = 0.95
    """PPO: GAE's lambda, in [0, 1]."""
    value_lr: float = 1.0e-4
    """PPO: learning rate of the value head (the policy's is train.lr)."""
    normalize_advantages: bool = True
    """PPO: GAE advantages normalised to mean 0, std 1 over each batch the actor trains (a micro-batch
    asynchronously, the round synchronously), as SB3's and CleanRL's PPO do; GRPO's are normalised within their
    group already."""
    queue_depth: int = 64
    """Messages each queue between roles holds before its sender blocks (back-pressure; never unbounded)."""
    peer_timeout_s: float = 120.0
    """The longest a role waits on a peer (a message, the rendezvous, a weight sync) before it ends the job naming
    the silent peer."""
    straggler_delay_s: float = 0.0
    """Benchmarks and tests: env worker 0 sleeps this long per step (the straggler of the RL-VLA3 paper); 0 on
    real runs."""
    train_seeds: list[int] = field(default_factory=lambda: [0])
    """Environment seeds RL trains on (of eval.suite's eval.tasks); evaluation keeps eval.seeds, which must not
    overlap them (held-out success)."""
    resources: RLResources = field(default_factory=RLResources)
    """rl.resources.actor / rollout / env: the heterogeneous job's groups."""

    def __post_init__(self) -> None:
        checks.choice("rl.algorithm", self.algorithm, ALGORITHMS)
        for key, (least, most, why) in INT_BOUNDS.items():
            bounded_int(f"rl.{key}", getattr(self, key), least, most, why)
        for key, bounds in FLOAT_BOUNDS.items():
            bounded_float(f"rl.{key}", getattr(self, key), bounds)
        self._check_seeds()
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ConfigError("a GRPO group of 1 rollout has no baseline: every advantage would be 0 and the "
                              "policy would never change", key="rl.group_size", fix="set rl.group_size=8 (2 or more)")
        if self.algorithm == "grpo" and self.episodes_per_iteration % self.group_size:
            fit = max(self.group_size, self.episodes_per_iteration // self.group_size * self.group_size)
            raise ConfigError(f"{self.episodes_per_iteration} episodes per iteration are not whole groups of "
                              f"rl.group_size={self.group_size}: a group cut short has a biased baseline",
                              key="rl.episodes_per_iteration", related=("rl.group_size",),
                              fix=f"set rl.episodes_per_iteration={fit} (a multiple of rl.group_size)")
        if self.async_ and self.max_staleness < 1:
            raise ConfigError("rl.async=true with rl.max_staleness=0: every sample in flight when the weights "
                              "change would be dropped, a slower synchronous pipeline", key="rl.max_staleness",
                              related=("rl.async",),
                              fix="set rl.max_staleness=1 (RLinf's default), or rl.async=false for on-policy runs")
        if self.episodes_per_iteration < self.actor_ranks:
            raise ConfigError(f"{self.episodes_per_iteration} episodes per version for rl.actor_ranks="
                              f"{self.actor_ranks}: a rank could get no sample and its collectives would wait for it",
                              key="rl.episodes_per_iteration", related=("rl.actor_ranks",),
                              fix=f"set rl.episodes_per_iteration to at least {self.actor_ranks}")
        for role in ROLES:
            getattr(self.resources, role).check(f"rl.resources.{role}")
            self.group(role)  # tasks_per_node against the role's process count

    def _check_seeds(self) -> None:
        if not self.train_seeds:
            raise ConfigError("needs at least one seed", key="rl.train_seeds", fix="e.g. rl.train_seeds=[100]")
        for seed in self.train_seeds:
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
                raise ConfigError(f"{seed!r} is not a seed from 0 to {MAX_SEED}", key="rl.train_seeds",
                                  fix="use seeds such as [100, 101]")
        if len(set(self.train_seeds)) != len(self.train_seeds):
            twice = next(seed for seed in self.train_seeds if self.train_seeds.count(seed) > 1)
            raise ConfigError(f"seed {twice} is listed twice", key="rl.train_seeds", fix="list each seed once")

    def role_sizes(self) -> dict[str, int]:
        """Processes of each role in the whole job, in group order: actor, rollout, env."""
        return {role: self.group(role).tasks for role in ROLES}

    def processes(self) -> str:
        """The job's processes in words: `16 actor, 8 rollout, 8 env process(es)`."""
        return ", ".join(f"{count} {role}" for role, count in self.role_sizes().items()) + " process(es)"

    def group(self, role: str) -> RoleGroup:
        """The group of `role` (actor, rollout or env) as the job runs it, tasks_per_node resolved."""
        res: RoleResources = getattr(self.resources, role)
        key = f"rl.resources.{role}"
        if role == "env":
            count, count_key, per_node = self.env_workers, "rl.env_workers", self.env_workers
        else:
            count_key = "rl.actor_ranks" if role == "actor" else "rl.rollout_workers"
            count = self.actor_ranks if role == "actor" else self.rollout_workers
            if count % res.nodes:
                raise ConfigError(f"{count} {role} processes ({count_key}) do not spread evenly over "
                                  f"{res.nodes} nodes", key=f"{key}.nodes", related=(count_key,),
                                  fix=f"set {key}.nodes to a divisor of {count}, or {count_key} to a multiple "
                                      f"of {res.nodes}")
            per_node = count // res.nodes
        if res.tasks_per_node is not None and res.tasks_per_node != per_node:
            raise ConfigError(f"{res.tasks_per_node} tasks per node on {res.nodes} node(s), and {count_key}="
                              f"{count} asks for {per_node} per node", key=f"{key}.tasks_per_node",
                              related=(count_key, f"{key}.nodes"),
                              fix=f"set {key}.tasks_per_node={per_node}, or remove it (it follows {count_key})")
        return RoleGroup(role, res.nodes, per_node, res.cpus_per_task, res.mem, res.gpus_per_node, res.partition)
