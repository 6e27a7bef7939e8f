"""One RL job, three roles: how each process finds its peers and runs its role (the synchronous and asynchronous
pipelines are the same processes; rl.async decides how the rollout batches and how the actor steps).

    run_role(config, run_dir, role_info, session=..., stop=..., sinks=...)

Process layout (embodyhpc.rl.roles gives each process its role): actor ranks form their own torch.distributed world
(FSDP2, the Checkpointer's and the stop agreement's collectives stay among them; its init address is published by
actor rank 0 through embodyhpc.rl.endpoints); weights go from actor rank 0 to the rollout workers over a gloo group
of their own (embodyhpc.rl.weights); everything else over pyzmq (embodyhpc.rl.transport): env worker w talks to
rollout worker w % R, every rollout worker streams to actor rank 0. Servers bind a free port on every interface
and publish it under <run>/rl/endpoints/; every wait for a peer is bounded by rl.peer_timeout_s.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from embodyhpc.config.schema import Config
from embodyhpc.rl import endpoints
from embodyhpc.rl.codec import Codec
from embodyhpc.rl.env_worker import EnvJob, EpisodePlan, supervise_env_role

WEIGHTS_ROLE = "weights"  # the endpoint of the weight group's store (actor rank 0)


def weight_timeout_s(peer_timeout_s: float) -> float:
    """The weight group's bound on one broadcast: the longest gap between two versions (an asynchronous actor step
    waits for its samples, which a slow or saturated run makes long), so longer than rl.peer_timeout_s. A dead
    actor still ends the rollouts sooner: its broken connection fails the receive at once, and a hung one fills
    their stream (the Pusher's bound); synchronous rounds wait for weights rl.peer_timeout_s (rollout.py)."""
    return max(10.0 * peer_timeout_s, 600.0)


def episode_plan(config: Config) -> EpisodePlan:
    rl = config.rl
    return EpisodePlan(tasks=tuple(config.eval.tasks), train_seeds=tuple(rl.train_seeds), group_size=rl.group_size,
                       num_slots=rl.role_sizes()["env"] * rl.envs_per_worker,
                       episodes_per_round=rl.episodes_per_iteration)


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def policy_io(config: Config) -> dict[str, Any]:
    """policy_io.json of the supervised policy RL starts from (cameras, image size), {} when it has none."""
    from embodyhpc.rundir import POLICY_IO_FILE

    path = Path(config.model.init_weights or "") / POLICY_IO_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def run_role(config: Config, run_dir: Path, role: Any, *, session: str, stop: Any = None,
             sinks: list | None = None) -> dict[str, Any]:
    """Run this process's role to its end; a summary of what it did."""
    run_dir = Path(run_dir)
    key = endpoints.run_key(run_dir)
    if role.role == "actor":
        return _actor(config, run_dir, role, key, session, stop, sinks)
    if role.role == "rollout":
        return _rollout(config, run_dir, role, key, session)
    return _env(config, run_dir, role, key, session)


def _actor(config: Config, run_dir: Path, role: Any, key: bytes, session: str, stop: Any,
           sinks: list | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from embodyhpc.rl.actor import Actor
    from embodyhpc.rl.transport import Puller
    from embodyhpc.rl.weight_sync import WeightSender, standalone_group
    from embodyhpc.train.preempt import StopSignal

    rl = config.rl
    timeout = rl.peer_timeout_s
    if role.role_rank == 0:
        init = endpoints.publish_dist_init(run_dir, session=session)
    else:
        init = endpoints.wait_dist_init(run_dir, session=session, timeout_s=timeout)
    gpus = rl.resources.actor.gpus_per_node > 0
    dist.init_process_group("nccl" if gpus else "gloo", init_method=init, rank=role.role_rank,
                            world_size=role.sizes["actor"], timeout=timedelta(seconds=max(timeout, 60.0)))
    puller = sender = None
    try:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if gpus else torch.device("cpu")
        if role.role_rank == 0:
            puller = Puller(Codec(key, sender="actor-0"), hwm=rl.queue_depth, timeout_s=timeout, host="*")
            endpoints.publish(run_dir, "actor", 0, port=_port(puller.address), session=session)
        actor = Actor(config, run_dir, device, sinks=sinks)
        if role.role_rank == 0:
            port = endpoints.free_port()
            endpoints.publish(run_dir, WEIGHTS_ROLE, 0, port=port, session=session)
            group = standalone_group("0.0.0.0", port, 0, role.sizes["rollout"] + 1, weight_timeout_s(timeout))
            sender = WeightSender(group, 0, timeout_s=weight_timeout_s(timeout))
        result = actor.run(puller, sender, stop or StopSignal())
        actor.ckpt.close()
        dist.barrier()
        return {"role": "actor", "start_version": result.start_version, "version": result.version,
                "stopped_by": result.stopped_by, "export_path": str(result.export_path or "") or None,
                "last_metrics": result.last_metrics}
    finally:
        if puller is not None:
            puller.close()
        dist.destroy_process_group()


def _rollout(config: Config, run_dir: Path, role: Any, key: bytes, session: str) -> dict[str, Any]:
    import torch

    from embodyhpc.checkpoint.sliced_weights import load_init_weights
    from embodyhpc.models import build_model, model_spec
    from embodyhpc.models.checkpoint_assets import resolve_normalizer
    from embodyhpc.rl.rollout import RolloutSettings, RolloutWorker
    from embodyhpc.rl.transport import Pusher, Server
    from embodyhpc.rl.weight_sync import WeightReceiver, standalone_group
    from embodyhpc.rundir import CHECKPOINTS_DIR

    rl, rank = config.rl, role.role_rank
    timeout = rl.peer_timeout_s
    name = f"rollout-{rank}"
    server = Server(Codec(key, sender=name), host="*", timeout_s=timeout, hwm=max(rl.queue_depth, 1))
    endpoints.publish(run_dir, "rollout", rank, port=_port(server.address), session=session)
    actor = endpoints.wait_for(run_dir, "actor", 0, session=session, timeout_s=timeout)
    pusher = Pusher(endpoints.tcp_address(actor), Codec(key, sender=name), peer="actor 0", hwm=rl.queue_depth,
                    timeout_s=timeout)
    torch.manual_seed(config.train.seed)
    model = build_model(config.model)  # fp32; its trainable weights come from the actor
    spec = model_spec(config.model.name)
    if config.model.init_weights:  # the frozen ones (GR00T's VLM, a LoRA base) never travel: the actor's start
        # (before standalone_group: load_init_weights gathers across a process group whenever one is up)
        load_init_weights(model, config.model.init_weights, spec.load("weights") if spec.weights is not None else None)
    if rl.resources.rollout.gpus_per_node > 0:  # an inference GPU (the rank's local one, as srun binds it)
        model.to(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))
    root = config.data.root if config.data.root and Path(config.data.root).exists() else None
    normalizer, _ = resolve_normalizer(config.model, root, run_checkpoints=run_dir / CHECKPOINTS_DIR)
    io = policy_io(config)
    dims = int(io.get("action_dim") or config.model.action_dim)
    runner = spec.load("inference")(
        model, config, normalizer=normalizer, execute_steps=rl.execute_steps, denoise_steps=rl.denoise_steps,
        num_action_dims=dims)
    weights_at = endpoints.wait_for(run_dir, WEIGHTS_ROLE, 0, session=session, timeout_s=timeout)
    group = standalone_group(weights_at["host"], int(weights_at["port"]), rank + 1, role.sizes["rollout"] + 1,
                             weight_timeout_s(timeout))
    weights = WeightReceiver(model, group, 0, timeout_s=weight_timeout_s(timeout), peer="actor 0").start()
    try:
        if not weights.wait_ready(timeout):
            raise RuntimeError("the actor said goodbye before sending any weights")
        start = weights.swap_if_ready()
        envs = [w for w in range(role.sizes["env"]) if w % role.sizes["rollout"] == rank]
        slots = tuple(w * rl.envs_per_worker + j for w in envs for j in range(rl.envs_per_worker))
        settings = RolloutSettings(rank=rank, slots=slots, plan=episode_plan(config), sync=not rl.async_,
                                   iterations=rl.iterations, denoise_steps=rl.denoise_steps,
                                   noise_level=rl.noise_level, peer_timeout_s=timeout, seed=config.train.seed,
                                   max_batch=max(len(slots), 1))
        worker = RolloutWorker(model, runner.observation_batch, server, pusher, weights, settings, action_dims=dims)
        stats = worker.run(start)
        weights.drain()
        return {"role": "rollout", "rank": rank, "start_version": start, "version": worker.version, **stats}
    finally:
        server.close()
        pusher.close()


def env_job(config: Config, run_dir: Path, role: Any, key: bytes, session: str) -> EnvJob:
    rl = config.rl
    rollout_rank = role.role_rank % role.sizes["rollout"]
    found = endpoints.wait_for(run_dir, "rollout", rollout_rank, session=session, timeout_s=rl.peer_timeout_s)
    io = policy_io(config)
    return EnvJob(suite=config.eval.suite, tasks=tuple(config.eval.tasks), cameras=tuple(io.get("cameras") or ()),
                  image_size=int(io.get("image_size") or config.eval.image_size),
                  suite_options=dict(config.eval.suite_options), plan=episode_plan(config), sync=not rl.async_,
                  envs_per_worker=rl.envs_per_worker, execute_steps=rl.execute_steps,
                  max_episode_steps=rl.max_episode_steps, straggler_delay_s=rl.straggler_delay_s,
                  rollout_address=endpoints.tcp_address(found), rollout_name=f"rollout {rollout_rank}", key=key,
                  timeout_s=rl.peer_timeout_s)


def _env(config: Config, run_dir: Path, role: Any, key: bytes, session: str) -> dict[str, Any]:
    job = env_job(config, run_dir, role, key, session)
    restarts = supervise_env_role(job, role.role_rank)
    return {"role": "env", "rank": role.role_rank, "restarts": restarts}
