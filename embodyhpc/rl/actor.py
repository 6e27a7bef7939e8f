"""The actor role: FSDP2 ranks that assemble the streamed pieces into episodes, admit samples by staleness, train
the policy with GRPO or PPO, checkpoint like training, and send the trainable weights to the rollout workers.

    actor = Actor(config, run_dir, device, sinks)   # every actor rank (the actor's own torch.distributed world)
    result = actor.run(puller, sender, stop)        # rank 0 reads the stream; every rank trains

Reused from training: the model is built on meta, parallelized (FSDP2 over the actor ranks), materialized seeded
with train.seed, AdamW (train/optim.py), the Checkpointer (<run>/checkpoints/step-<version>, RNG states, the
version counter as the step), the side files (train/loop.write_policy_io) and the export folder evaluations read.

Versions: the version is the number of optimizer steps (a resume continues from the checkpoint's step). Synchronous
mode: one round of rl.episodes_per_iteration episodes, all produced by the current version, is one optimizer step
over all its chunk samples (micro-batches of rl.micro_batch_size per rank, gradients accumulated). Asynchronous
mode: samples are admitted as their groups finish, and a step is taken once train.global_batch_size of them are
in (`_batch_due`: or fewer, when a policy that succeeds almost everywhere makes them rare), then the weights go out.
A step trains every sample admitted since the one before, so it ends at a group's end: a group is never split over
two versions (half a GRPO group is a gradient whose advantages do not sum to 0, and Adam moves the policy as far
on it as on a whole batch).
GRPO leaves out the samples of a group whose rewards are all equal: their advantage is 0, they add nothing to the
gradient, and counted in the mean they would only shrink the step (counted: rl/zero_advantage_samples).

Admission: a sample reaches a loss only through the StalenessGate (at most rl.max_staleness versions old), checked
when its group completes; the step that trains it is the next one, so none is older than the bound when trained.
The loss mask counts the executed actions (the first rl.execute_steps of a chunk) on the robot's real action dims:
the rest of a chunk never reaches the simulator and carries no reward signal.
Losses: GRPO sync: PPO's clipped ratio against the behaviour log-probability; GRPO async: truncated importance
weights (rl.behav_cap); PPO: GAE advantages from the critic (embodyhpc.rl.critic) with the clipped ratio (sync) or
decoupled PPO (async; the proximal policy is the actor's weights at the start of the step, which are the weights
every micro-batch of that step is computed with, so its log-probability is the current one, detached).

Only actor rank 0 reads the stream: it decides what every rank trains on and sends it (broadcast_object_list over
the actor's CPU group); the other ranks follow the same sequence of collectives.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from embodyhpc.checkpoint import Checkpointer
from embodyhpc.checkpoint.sliced_weights import load_init_weights
from embodyhpc.config.schema import Config
from embodyhpc.models import build_model, model_spec
from embodyhpc.parallel import materialize, parallelize
from embodyhpc.parallel.mesh import SHARD_DIM
from embodyhpc.rl import losses
from embodyhpc.rl.assembly import Assembler, Episode, Window
from embodyhpc.rl.flow_sde import trajectory_log_prob
from embodyhpc.rl.samples import ChunkSample, StalenessGate, VersionCounter
from embodyhpc.rl.transport import PeerTimeout
from embodyhpc.rl.weight_sync import trainable_state
from embodyhpc.rundir import CHECKPOINTS_DIR, EXPORT_DIR, RESOLVED_YAML
from embodyhpc.train.optim import build_optimizer
from embodyhpc.train.preempt import StopSignal, cpu_group

PULL_BATCH = 256
ZERO_ADVANTAGE = 1e-6
FLAT_BATCHES, FLAT_BATCHES_MAX = 2, 8  # see Actor._batch_due
STOP_POLL_S = 1.0  # rank 0 looks at the stop signal at least this often while it waits for samples
KEEPALIVE_S = 10.0  # ... and tells the other actor ranks it is alive at least this often (or rl.peer_timeout_s / 4)
KEEPALIVE = "alive"


@dataclass
class ActorResult:
    start_version: int
    version: int
    stopped_by: str | None
    export_path: Path | None
    last_metrics: dict[str, float]


class Actor:
    def __init__(self, config: Config, run_dir: Path, device: torch.device, *, sinks: list | None = None,
                 on_checkpoint: Any = None) -> None:
        self.config, self.rl, self.run_dir, self.device = config, config.rl, Path(run_dir), device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.spec = model_spec(config.model.name)
        mesh = init_device_mesh(device.type, (self.world,), mesh_dim_names=(SHARD_DIM,))
        with torch.device("meta"):
            self.model = build_model(config.model, config.precision)
        parallelize(self.model, config.parallelism, config.precision, mesh)
        materialize(self.model, device, seed=config.train.seed)
        self.optimizer = build_optimizer(self.model, lr=config.train.lr, weight_decay=config.train.weight_decay)
        torch.manual_seed(config.train.seed + self.rank)
        # the stream's decisions and the stop agreement travel here; with NCCL a gloo side group, which waits as
        # long as the actor's world does (pipeline: max(rl.peer_timeout_s, 60 s)), not cpu_group's default 300 s
        self.group = cpu_group(max(self.rl.peer_timeout_s, 60.0))
        self.ckpt = Checkpointer(self.run_dir / CHECKPOINTS_DIR, config.checkpoint, seed=config.train.seed,
                                 device=device, on_complete=on_checkpoint)
        self.normalizer, self.side_files = self._policy_inputs()
        loaded = self.ckpt.load_latest(self.model, self.optimizer)
        if loaded is None and config.model.init_weights:
            report = load_init_weights(self.model, config.model.init_weights,
                                       self.spec.load("weights") if self.spec.weights is not None else None)
            if self.rank == 0:
                print(f"rl actor: init weights {report.summary()}", flush=True)
        self.version = VersionCounter(loaded.step if loaded is not None else 0)
        self.start_version = self.version.value
        self.runner = self.spec.load("inference")(self.model, self.config, normalizer=self.normalizer,
                                                  execute_steps=self.rl.execute_steps,
                                                  denoise_steps=self.rl.denoise_steps,
                                                  num_action_dims=self.action_dims)
        # eval mode, not train: the actor scores the rollouts' chunks with the policy that sampled them, and dropout
        # (GR00T's action head: 0.2 at full size; a LoRA adapter's) would make every score a random mask's, never
        # the behaviour policy's (an on-policy ratio of 1). Gradients flow in eval mode.
        self.model.eval()
        self.gate = StalenessGate(self.rl.max_staleness)
        self.critic = None
        if self.rl.algorithm == "ppo":
            self._build_critic(loaded is not None)
        self.sinks = sinks or []
        self.last_metrics: dict[str, float] = {}

    # ---- set-up ----
    def _policy_inputs(self) -> tuple[Any, dict]:
        """The state normaliser the policy was trained with, and the side files exports carry (as training)."""
        from embodyhpc.models.checkpoint_assets import resolve_normalizer, resolve_tokenizer
        from embodyhpc.train.loop import write_policy_io

        root = self.config.data.root
        data_root = root if root and Path(root).exists() else None
        checkpoints = self.run_dir / CHECKPOINTS_DIR
        normalizer, _ = resolve_normalizer(self.config.model, data_root, run_checkpoints=checkpoints)
        tokenizer, _ = resolve_tokenizer(self.config.model, run_checkpoints=checkpoints)
        self.config = dataclasses.replace(self.config, model=dataclasses.replace(self.config.model,
                                                                                 tokenizer_path=tokenizer))
        from embodyhpc.rundir import POLICY_IO_FILE

        init = Path(self.config.model.init_weights or "")
        io_file = init / POLICY_IO_FILE
        dims = None
        if io_file.is_file():
            import json

            dims = json.loads(io_file.read_text()).get("action_dim")
        self.action_dims = int(dims or self.config.model.action_dim)
        side: dict = {}
        if self.rank == 0:
            checkpoints.mkdir(parents=True, exist_ok=True)
            if data_root is not None:
                side = write_policy_io(checkpoints, data_root, self.config.model, normalizer, tokenizer)
            else:  # no dataset: the supervised policy's own side files
                from embodyhpc.data.normalize import NORM_FILE

                normalizer.save(checkpoints)
                side = {NORM_FILE: checkpoints / NORM_FILE}
                if io_file.is_file():
                    shutil.copy2(io_file, checkpoints / POLICY_IO_FILE)
                    side[POLICY_IO_FILE] = checkpoints / POLICY_IO_FILE
        return normalizer, side

    def _build_critic(self, loaded: bool) -> None:
        """PPO's value head (embodyhpc.rl.critic.ValueHead) on the policy's normalised state and the task's index;
        its weights and optimizer beside the checkpoints, restored on resume."""
        from embodyhpc.rl.critic import ValueHead

        raw_dim = len(self.normalizer.offset) or int(self.config.model.state_dim or 1)
        self.critic = ValueHead(self.config, self.normalizer, raw_dim, self.device, self.run_dir / CHECKPOINTS_DIR)
        if not self.critic.load(self.version.value) and loaded and self.rank == 0:
            print(f"rl actor: no {self.critic.file(self.version.value).name} beside checkpoint step "
                  f"{self.version.value}: the value head starts again from zero", flush=True)

    # ---- weights ----
    # ---- the loop ----
    def run(self, puller: Any, sender: Any, stop: StopSignal) -> ActorResult:
        """Until rl.iterations versions (or a stop signal): train, step, send the weights; save and export."""
        sync_s = self._send(sender, last=self.version.value >= self.rl.iterations)
        stopped_by = None
        assembler = Assembler(self.rl.group_size if self.rl.algorithm == "grpo" else 1)
        window = Window()
        while self.version.value < self.rl.iterations:
            step_started = time.perf_counter()
            stopped_by = self.next_step(puller, assembler, window, stop)
            if stopped_by is not None:  # a stop signal came while rank 0 waited for samples: save this version
                self.optimizer.zero_grad(set_to_none=True)
                sync_s = self._send(sender, last=True)
                break
            version = self.version.advance()
            stopped_by = stop.agreed(self.group)
            last = version >= self.rl.iterations or stopped_by is not None
            window.times["sync_s"] += self._send(sender, last=last) + sync_s
            sync_s = 0.0
            window.times["actor_s"] += time.perf_counter() - step_started - window.times.pop("wait_s", 0.0)
            self._log(version, window, assembler)
            window = Window()
            if stopped_by is not None:
                break
            if self.ckpt.due(version):
                self._save(version, blocking=False)
        self._save(self.version.value, blocking=True)
        export = None
        if stopped_by is None and self.config.checkpoint.export_final:
            export = self.ckpt.export(self.run_dir / EXPORT_DIR, config_yaml=self._config_yaml(),
                                      step=self.version.value, side_files=self.side_files)
        return ActorResult(self.start_version, self.version.value, stopped_by, export, self.last_metrics)

    def _config_yaml(self) -> str:
        path = self.run_dir / RESOLVED_YAML
        return path.read_text() if path.is_file() else ""

    def _save(self, version: int, *, blocking: bool) -> None:
        self.ckpt.save(version, self.model, self.optimizer, blocking=blocking, extra={"rl_version": version})
        if self.critic is not None and self.rank == 0:
            self.critic.save(version)

    def _send(self, sender: Any, *, last: bool) -> float:
        """The trainable weights to the rollout workers (gathered by every actor rank), then, after the last
        version, the goodbye that ends them. Seconds it took."""
        started = time.perf_counter()
        state = trainable_state(self.model)  # a collective under FSDP2: every actor rank
        if self.rank == 0 and sender is not None:
            sender.send(state, self.version.value)
            if last:
                sender.close()
        return time.perf_counter() - started

    # ---- rank 0: what the next optimizer step trains on ----
    def next_step(self, puller: Any, assembler: Assembler, window: Window,
                  stop: StopSignal | None = None) -> str | None:
        """Every rank: one optimizer step. Sync: the round's samples, then the step. Async (level 3): each
        micro-batch trained as soon as its samples are admitted, the step once the batch is due. The name of a stop
        signal (nothing stepped) when one arrives while rank 0 waits."""
        consumed, ready = 0, []  # ready: admitted, not trained yet (a step takes them all: none outlives it)
        while True:
            box = self._collect(puller, assembler, ready, window, stop, consumed)
            if isinstance(box, str):
                return box
            kind, items = box
            self._accumulate(items, window, len(items) if not self.rl.async_ else self.config.train.global_batch_size)
            consumed += len(items)
            if kind == "step":
                self._step(window, consumed)
                return None

    def _collect(self, puller: Any, assembler: Assembler, ready: list, window: Window,
                 stop: StopSignal | None = None, consumed: int = 0) -> tuple[str, list] | str:
        """Rank 0 pulls until it can say what every rank trains next, and broadcasts it: ("micro", samples) (async:
        a micro-batch's worth of every rank admitted), ("step", samples) (the last ones of the step: a whole round
        in sync mode; in async mode every admitted sample not trained yet, once train.global_batch_size are in, so
        that each group lands whole in one step), or the name of a stop signal that arrived
        meanwhile (waiting for samples may take longer than the signal's warning).

        The other ranks wait in the broadcast meanwhile, each wait bounded by the group's timeout; a round may take
        longer than that while the rollouts are alive (a synchronous round is a whole rl.episodes_per_iteration of
        episodes), so rank 0 sends them a keep-alive (KEEPALIVE) every min(KEEPALIVE_S, rl.peer_timeout_s / 4)
        seconds: a wait on a live rank 0 never times out, a dead or stuck one still ends theirs."""
        box: list[Any] = [None]
        if self.rank == 0:
            target = self.config.train.global_batch_size
            per_micro = self.rl.micro_batch_size * self.world
            self._last_heard = told = time.monotonic()
            keepalive_s = min(KEEPALIVE_S, self.rl.peer_timeout_s / 4)
            while True:
                if self.world > 1 and time.monotonic() - told >= keepalive_s:
                    dist.broadcast_object_list([KEEPALIVE], src=0, group=self.group)
                    told = time.monotonic()
                received = stop.received if stop is not None else None
                if received is not None:
                    box[0] = received.name
                    break
                for group in assembler.complete_groups():
                    ready.extend(self._admit(group, window))
                if (self._batch_due(consumed + len(ready), window.zero_advantage, target) if self.rl.async_
                        else window.episodes >= self.rl.episodes_per_iteration):
                    box[0], ready[:] = self._box("step", list(ready)), []  # all of it, in both modes
                    break
                if self.rl.async_ and len(ready) >= per_micro:
                    box[0], ready[:] = self._box("micro", ready[:per_micro]), ready[per_micro:]
                    break
                waited = time.perf_counter()
                for message in self._pull(puller):
                    assembler.take(message)
                window.times["wait_s"] += time.perf_counter() - waited
            dist.broadcast_object_list(box, src=0, group=self.group)
            return box[0]
        while True:  # the other ranks: rank 0's keep-alives, then what to train
            dist.broadcast_object_list(box, src=0, group=self.group)
            if box[0] != KEEPALIVE:
                return box[0]

    def _box(self, kind: str, items: list[tuple[ChunkSample, float]]) -> tuple[str, list]:
        """What rank 0 broadcasts: PPO with rl.normalize_advantages has the advantages normalised over the samples
        of this box (losses.normalize_advantages: a micro-batch asynchronously, the whole round synchronously), so
        that a failed episode weighs against a successful one even while the critic's values are still near 0."""
        if self.critic is not None and self.rl.normalize_advantages and items:
            adv = losses.normalize_advantages(torch.tensor([a for _, a in items], dtype=torch.float64))
            items = [(sample, a) for (sample, _), a in zip(items, adv.tolist(), strict=True)]
        return kind, items

    @staticmethod
    def _batch_due(informative: int, flat: int, target: int) -> bool:
        """Async: a step is due with `target` samples that carry a gradient; or, once a policy succeeds (or fails)
        almost everywhere and such samples are rare, with those there are after FLAT_BATCHES x target samples of
        groups with equal rewards (FLAT_BATCHES_MAX x target: even with none, so that a run always ends)."""
        seen = informative + flat
        return (informative >= target or (informative > 0 and seen >= FLAT_BATCHES * target)
                or seen >= FLAT_BATCHES_MAX * target)

    def _pull(self, puller: Any) -> list:
        """What the rollout workers sent within STOP_POLL_S ([] if nothing: the caller looks at the stop signal);
        PeerTimeout naming them once they were silent for rl.peer_timeout_s (a dead rollout worker ends the job)."""
        bound = self.rl.peer_timeout_s
        try:
            messages = puller.pull_many(PULL_BATCH, min(STOP_POLL_S, bound))
        except PeerTimeout:
            if time.monotonic() - self._last_heard > bound:
                raise PeerTimeout("rollout workers", bound) from None
            return []
        self._last_heard = time.monotonic()
        return messages

    def _admit(self, group: list[Episode], window: Window) -> list[tuple[ChunkSample, float]]:
        """The group's samples that pass the staleness gate, each with its advantage."""
        rewards = torch.tensor([float(e.end.success) for e in group])
        window.add_episodes(group)
        ordered = [[s for _, s in sorted(e.samples.items())] for e in group]  # each episode's chunks in order
        if self.rl.algorithm == "grpo":
            adv = losses.group_advantages(rewards, torch.zeros(len(group), dtype=torch.long)).tolist()
            per_sample = [[a] * len(samples) for a, samples in zip(adv, ordered, strict=True)]
        else:
            per_sample = [self.critic.advantages(samples, bool(e.end.success))
                          for samples, e in zip(ordered, group, strict=True)]
        out = []
        for samples, advs in zip(ordered, per_sample, strict=True):
            for sample, a in zip(samples, advs, strict=True):
                if not self.gate.admit(sample.version, self.version.value):
                    continue
                if self.rl.algorithm == "grpo" and abs(a) < ZERO_ADVANTAGE:
                    window.zero_advantage += 1  # a group of equal rewards: no gradient, and it would dilute the mean
                    continue
                out.append((sample, float(a)))
        return out

    # ---- every rank: one optimizer step ----
    def _accumulate(self, items: list[tuple[ChunkSample, float]], window: Window, total: int) -> None:
        """Forward and backward of `items` in micro-batches (each rank its share), gradients accumulated, scaled so
        that `total` samples make the mean. FSDP2 reduce-scatters on every micro-batch: in async mode none is known
        to be the last when it runs."""
        per_micro = self.rl.micro_batch_size * self.world
        micro = [items[i: i + per_micro] for i in range(0, len(items), per_micro)]
        for index, chunk in enumerate(micro):  # none: a round of groups with equal rewards, the step changes nothing
            mine = chunk[self.rank::self.world]
            if isinstance(self.model, FSDPModule):
                self.model.set_requires_gradient_sync(self.rl.async_ or index == len(micro) - 1)
            weight = len(mine) * self.world / max(total, 1)
            stats = self._micro_batch(mine or chunk[:1], weight if mine else 0.0)
            window.add_loss(stats, len(mine))
        window.samples += len(items)
        if self.critic is not None and self.rank == 0:
            trained = [s for s, _ in items]
            window.add_values(trained, self.critic.out_of_range(trained))

    def _step(self, window: Window, consumed: int) -> None:
        """Clip, optimizer step (the policy's and the critic's). Async: gradients were scaled for
        train.global_batch_size samples; a step with fewer (_batch_due) or more (the rest of its last group) is
        rescaled to their mean."""
        target = self.config.train.global_batch_size
        if self.rl.async_ and 0 < consumed != target:
            for param in [*self.model.parameters(), *(self.critic.parameters() if self.critic is not None else [])]:
                if param.grad is not None:
                    param.grad.mul_(target / consumed)
        norm = torch.nn.utils.clip_grad_norm_(list(self.model.parameters()),
                                              self.config.train.grad_clip if self.config.train.grad_clip > 0
                                              else float("inf"))
        window.loss["grad_norm"] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            window.loss["value_grad_norm"] = self.critic.step(self.world, self.group, self.config.train.grad_clip)

    def _micro_batch(self, items: list[tuple[ChunkSample, float]], weight: float) -> dict[str, float]:
        samples = [s for s, _ in items]
        batch = self.runner.observation_batch([s.observation for s in samples]).to(self.device)
        trajectory = torch.from_numpy(np.stack([s.trajectory for s in samples])).to(self.device)
        behav = torch.from_numpy(np.stack([s.log_prob for s in samples])).to(self.device)
        adv = torch.tensor([a for _, a in items], dtype=torch.float32, device=self.device)
        logp = trajectory_log_prob(self.model, batch, trajectory, noise_level=self.rl.noise_level)
        mask = torch.zeros(trajectory.shape[0], *trajectory.shape[2:], device=self.device)
        mask[:, : self.rl.execute_steps, : self.action_dims] = 1.0
        if self.rl.async_ and self.rl.algorithm == "grpo":
            loss, stats = losses.truncated_is_loss(logp, behav, adv, mask, self.rl.behav_cap)
        elif self.rl.async_:
            loss, stats = losses.decoupled_ppo_loss(logp, logp.detach(), behav, adv, mask, self.rl.clip_eps,
                                                    self.rl.behav_cap)
        else:
            loss, stats = losses.ppo_clip_loss(logp, behav, adv, mask, self.rl.clip_eps)
        (loss * weight).backward()
        out = {f"loss/{k}": float(v) for k, v in stats.items()}
        out["loss/policy"] = float(loss.detach())
        if self.critic is not None and weight > 0:
            vloss = self.critic.loss(samples)
            (vloss * weight).backward()
            out["loss/value"] = float(vloss.detach())
        return out

    # ---- metrics ----
    def _log(self, version: int, window: Window, assembler: Assembler) -> None:
        if self.rank != 0:
            return
        metrics = window.metrics()
        metrics.update(self.gate.metrics())
        self.gate.reset()
        for key in ("env_s", "rollout_s", "env_steps"):
            value = assembler.times.pop(key, 0.0)
            if key == "env_steps":
                metrics["rl/env_steps_per_s"] = value / max(window.elapsed(), 1e-9)
            else:
                metrics[f"time/{key}"] = value
        metrics["rl/episodes_restarted"] = float(assembler.restarted)
        metrics["rl/version"] = float(version)
        self.last_metrics = metrics
        for sink in self.sinks:
            sink.write(version, metrics)
