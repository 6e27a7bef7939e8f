"""The training job's entry point (every rank runs `train_task`).

With a dataset (`data.format` lerobot or hdf5) the job stages it to node-local storage when asked, then
trains the recipe's policy with the FSDP2 loop of embodyhpc.train (DCP checkpoints, resume, export).
With `data.format: synthetic` it runs a small real stand-in instead: a data-parallel least-squares model
whose gradients are averaged with all_reduce over gloo and whose progress is checkpointed, so the launch
path (rank discovery across nodes, rendezvous, collectives, requeue and resume) is exercised in seconds.

Preemption and time limits (both loops): the sbatch script asks Slurm for SIGUSR2 `resources.signal_delay_s`
before the limit. From the start of `train_task`, SIGUSR2 and SIGTERM only set a flag on the rank that gets them
(embodyhpc.train.preempt.StopSignal, in place of submitit's handler, which would run the save on rank 0 alone);
at the next step boundary all ranks agree on it, stop at the same step and save it together (blocking). Then:
- SIGUSR2, fewer than `resources.max_requeues` restarts so far: rank 0 requeues the job once (`scontrol requeue`;
  under submitit's local executor, the exit code asks it to restart the tasks) and every rank exits with
  preempt.Requeued (no result file: submitit treats the attempt as requeued, and sacct shows REQUEUED). The next
  attempt resumes at exactly the saved step.
- SIGUSR2 with the retry limit reached (or a failed requeue): the job fails with TrainingStopped, whose message
  (which step was saved, how many restarts, which key to raise) is in the log and in logs/train_result.json.
- SIGTERM (Slurm ends the job: cancel, or preemption it handles itself): saved, not requeued by us; every rank
  exits with preempt.Stopped (no result file) and the job's state is whatever Slurm makes it.
Every attempt that stops appends one line to logs/train_attempts.jsonl (rank 0).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from embodyhpc.atomic import write_json_atomic
from embodyhpc.config.schema import CheckpointConfig, Config, DataConfig, StagingConfig, TrainConfig
from embodyhpc.launch import distributed, observe
from embodyhpc.launch.requeue import TrainingStopped, end_stopped_attempt
from embodyhpc.launch.requeue import decide_and_requeue as _decide_and_requeue
from embodyhpc.launch.requeue import restart_count as _restart_count
from embodyhpc.rundir import (
    ATTEMPTS_FILE,  # noqa: F401 - where launch.requeue records the attempts (tests read it from here)
    METRICS_FILE,
    RESULT_FILE,
    SPINE_STATE_FILE,
    replace_atomically,
)
from embodyhpc.train.preempt import StopSignal
from embodyhpc.validation import load_resolved

_DIM = 16
_HOST_BYTES = 64


def prepare_data(data: DataConfig, staging: StagingConfig, local_rank: int) -> str | None:
    """The folder training reads: the node-local staged copy when staging is on (local rank 0 of each
    node copies, the other local ranks wait), else data.root. Runs before the process group exists."""
    if data.format == "synthetic":
        return None
    if data.datasets:  # a mixture: train_task stages every dataset with prepare_datasets
        raise ValueError("prepare_data reads data.root; a mixture (data.datasets) goes through prepare_datasets")
    root = Path(str(data.root))
    if not root.exists():
        raise FileNotFoundError(f"data.root {data.root!r} does not exist on {socket.gethostname()}")
    if not staging.enabled:
        return str(root)
    from embodyhpc.staging import node_local_path, stage_on_node

    dest = node_local_path(staging.nvme_dir, root)
    stage_on_node(root, dest, local_rank=local_rank, workers=staging.copy_workers, verify=staging.verify,
                  progress=False)
    return str(dest)


def prepare_datasets(data: DataConfig, staging: StagingConfig, local_rank: int) -> DataConfig:
    """data.datasets with each root replaced by the folder training reads: its node-local staged copy when staging is
    on (staging/datasets.py: every dataset, local rank 0 copies), else the root itself, which must exist here."""
    import dataclasses

    for i, entry in enumerate(data.datasets or ()):
        if not Path(entry.root).exists():
            raise FileNotFoundError(f"data.datasets[{i}].root {entry.root!r} does not exist on {socket.gethostname()}")
    if not staging.enabled:
        return data
    from embodyhpc.staging.datasets import stage_datasets

    staged = stage_datasets([entry.root for entry in data.datasets or ()], nvme_dir=staging.nvme_dir,
                            local_rank=local_rank, workers=staging.copy_workers, verify=staging.verify)
    return dataclasses.replace(data, datasets=[dataclasses.replace(entry, root=root)
                                               for entry, root in zip(data.datasets or (), staged, strict=True)])


def train_task(run_dir: str) -> dict:
    """Every rank: stage data, join the process group, train, and (rank 0) write the result file.

    A recipe with a dataset trains its policy with the FSDP2 loop (embodyhpc.train); `data.format: synthetic`
    runs the small data-parallel stand-in below, which exercises the same launch path in seconds.
    A stop signal ends the attempt early (see the module doc): requeued (Requeued) or failed (TrainingStopped).
    """
    config = load_resolved(run_dir)
    dist_env = distributed.from_job_environment()
    # Installed for the rest of the process on purpose: with submitit's handler back after we return, a late
    # SIGUSR2 would make its rank 0 requeue a job that has already finished training.
    stop = StopSignal().install()
    observe.preflight(Path(run_dir), config, dist_env.local_rank)  # a bad node fails here, naming itself
    staged = prepare_datasets(config.data, config.staging, dist_env.local_rank) if config.data.datasets else None
    data_root = staged.datasets[0].root if staged else prepare_data(config.data, config.staging, dist_env.local_rank)
    tracking = observe.RunTracking(config, Path(run_dir), rank=dist_env.rank, local_rank=dist_env.local_rank,
                                   node_rank=dist_env.node_rank)
    device, backend = device_and_backend(config.resources.gpus_per_node, synthetic=data_root is None)
    with tracking.attempt(), _failure_recorded(Path(run_dir), dist_env.rank):
        # the device is bound (current) before the process group exists; see distributed.rank_device
        with distributed.process_group(dist_env, backend=backend, device=device, run_dir=run_dir) as device:
            hostnames = _gather_hostnames(dist_env.world_size)
            if data_root is None:
                result = _spine_loop(dist_env, config.train, config.checkpoint, Path(run_dir), stop,
                                     step_s=config.data.synthetic_step_s)
                tracking.log_final(result["steps"], {"final_loss": result["final_loss"]})
            else:
                result = _train_policy(config, Path(run_dir), data_root, dist_env, stop, tracking.sinks(), device,
                                       staged_data=staged)
            stopped = None
            if result["stopped_by"] is not None:  # the same on every rank: the loops agree on it
                stopped = _after_stop(result, config.resources.max_requeues, Path(run_dir), dist_env)
        result.update(data_root=data_root, hostnames=hostnames, world_size=dist_env.world_size,
                      restart_count=_restart_count(Path(run_dir), dist_env.job_id), job_id=dist_env.job_id)
        if stopped is not None:
            end_stopped_attempt(stopped, result, Path(run_dir), write_result=dist_env.rank == 0)
    result["status"] = "completed"
    if dist_env.rank == 0:
        write_json_atomic(Path(run_dir) / RESULT_FILE, result)
        if result.get("export_path") and tracking.sink is not None:  # off the critical path: a warning at worst
            from embodyhpc.launch.policy_model import log_training_model

            log_training_model(tracking.uri, tracking.run_id, Path(result["export_path"]).parent,
                               step=int(result.get("steps") or 0))
    # Training is done: a time-limit warning arriving now means nothing. Ignore it for the rest of the process,
    # because at interpreter shutdown CPython puts Python-level handlers back to the default (terminate), and a
    # late USR2 would then kill a finished task and turn a COMPLETED job into a FAILED one (seen in CI).
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    return result


@contextlib.contextmanager
def _failure_recorded(run_dir: Path, rank: int) -> Iterator[None]:
    """Rank 0: a training attempt that raised leaves logs/train_result.json saying so, with the error on one line
    (the one every rank raised when the data failed: train/stream.py), for `status`, the report and MLflow's
    failure logs. The exception goes on: the job fails with it (exit code 1, run.json FAILED with its last line)."""
    try:
        yield
    except TrainingStopped:
        raise  # recorded already, with the attempt's result (end_stopped_attempt)
    except Exception as exc:
        if rank == 0:
            from embodyhpc.data.guard import one_line

            try:
                write_json_atomic(run_dir / RESULT_FILE, {"status": "failed", "error": one_line(exc),
                                                          "job_id": os.environ.get("SLURM_JOB_ID")})
            except OSError as record_exc:  # the record is for people; the job fails with `exc` either way
                print(f"train: could not record the failure in {RESULT_FILE}: {record_exc}", flush=True)
        raise


# ---- after a stop signal (the decision and the way out: embodyhpc.launch.requeue) ----
def _after_stop(result: dict, max_requeues: int, run_dir: Path, dist_env: distributed.DistEnv) -> dict[str, Any]:
    """Every rank, inside the process group, after the loop saved the stop step: rank 0 decides (and requeues),
    then one broadcast gives every rank the same outcome."""
    import torch.distributed as dist

    decision: list[Any] = [None]
    if dist_env.rank == 0:
        try:
            decision[0] = _decide_and_requeue(result, max_requeues, run_dir, dist_env.job_id)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait in the broadcast below: always reach it
            decision[0] = {"outcome": "failed", "message": f"stopped by {result['stopped_by']} at step "
                                                           f"{result['stopped_at_step']}, then rank 0 failed: {exc!r}"}
    dist.broadcast_object_list(decision, src=0)
    return decision[0]


def device_and_backend(gpus_per_node: int, *, synthetic: bool) -> tuple[str, str]:
    """cuda + nccl when the recipe asks for GPUs (one per local rank), else cpu + gloo. The synthetic stand-in
    always runs on the CPU over gloo. Asking for GPUs on a node where torch sees none is an error here, not a
    silent CPU run (the preflight has already checked the count through NVML)."""
    if gpus_per_node <= 0 or synthetic:
        return "cpu", "gloo"
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"the recipe asks for {gpus_per_node} GPU(s) per node (resources.gpus_per_node) but "
                           f"torch sees no CUDA device on {socket.gethostname()} (a CPU-only torch build, or "
                           "CUDA_VISIBLE_DEVICES empty); set resources.gpus_per_node=0 to train on CPUs")
    return "cuda", "nccl"


def _train_policy(config: Config, run_dir: Path, data_root: str, dist_env: distributed.DistEnv,
                  stop: StopSignal, extra_sinks: list, device: Any, staged_data: DataConfig | None = None) -> dict:
    import dataclasses

    from embodyhpc.config.resolve import resolve
    from embodyhpc.launch import checkpoint_eval
    from embodyhpc.rundir import RESOLVED_YAML
    from embodyhpc.train.loop import train

    data = staged_data if staged_data is not None else dataclasses.replace(config.data, root=data_root)
    out = train(dataclasses.replace(config, data=data), resolve(config),
                run_dir=run_dir, dist_env=dist_env, device=device, config_yaml=(run_dir / RESOLVED_YAML).read_text(),
                stop=stop, extra_sinks=extra_sinks, on_checkpoint=checkpoint_eval.hook(run_dir, config))
    return {"mode": "policy", "resumed_from_step": out.start_step, "steps": out.final_step,
            "last_metrics": out.last_metrics, "export_path": str(out.export_path) if out.export_path else None,
            "stopped_by": out.stopped_by, "stopped_at_step": out.final_step if out.stopped_by else None}


def _gather_hostnames(world: int) -> list[str]:
    """all_gather of fixed-size byte tensors (all_gather_object would need numpy), on a gloo group (CPU tensors
    cannot travel over NCCL)."""
    import torch
    import torch.distributed as dist

    from embodyhpc.train.preempt import cpu_group

    mine = torch.zeros(_HOST_BYTES, dtype=torch.uint8)
    raw = socket.gethostname().encode()[:_HOST_BYTES]
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=cpu_group())
    return [bytes(t.tolist()).rstrip(b"\0").decode() for t in gathered]


def _spine_loop(dist_env: distributed.DistEnv, train: TrainConfig, ckpt: CheckpointConfig,
                run_dir: Path, stop: StopSignal, *, step_s: float = 0.0) -> dict:
    import torch
    import torch.distributed as dist

    world, rank = dist_env.world_size, dist_env.rank
    # every rank proves it can reach every other: sum of (rank + 1) and all host names
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)

    true_w = torch.randn(_DIM, generator=torch.Generator().manual_seed(train.seed))
    weights = torch.zeros(_DIM)
    start_step = 0
    state_path = run_dir / SPINE_STATE_FILE
    if state_path.exists():  # resume after requeue: rank 0 reads, everyone receives the same
        state = torch.load(state_path) if rank == 0 else {"step": 0, "weights": weights}
        weights, start_step = state["weights"], int(state["step"])
    header = torch.cat([torch.tensor([float(start_step)]), weights])
    dist.broadcast(header, src=0)
    start_step, weights = int(header[0].item()), header[1:].clone()

    per_rank = max(train.global_batch_size // world, 1)
    t0 = time.monotonic()
    loss = torch.tensor(0.0)
    stopped_by, stopped_at = None, None
    # the metrics file the policy trainer writes too, so that status and submit show this run's progress alike
    from embodyhpc.train.metrics import JsonlMetricsSink

    metrics = JsonlMetricsSink(run_dir / METRICS_FILE, resume_step=start_step) if rank == 0 else None
    logged_at, logged_step = time.monotonic(), start_step
    paced_until = time.monotonic()
    for step in range(start_step, train.steps):
        if step_s:  # data.synthetic_step_s: every rank waits out the step's pace, so the all-reduce keeps them in step
            paced_until = max(paced_until + step_s, time.monotonic())
            time.sleep(max(paced_until - time.monotonic(), 0.0))
        gen = torch.Generator().manual_seed(train.seed * 1_000_003 + step * world + rank)
        x = torch.randn(per_rank, _DIM, generator=gen)
        y = x @ true_w
        err = x @ weights - y
        grad = 2 * x.T @ err / per_rank
        stats = torch.cat([grad, (err.pow(2).mean()).reshape(1)])
        dist.all_reduce(stats)
        stats /= world
        lr = train.lr * min(1.0, (step + 1) / max(train.warmup_steps, 1))
        weights -= lr * stats[:-1]
        loss = stats[-1]
        if rank == 0 and (step + 1) % train.log_every == 0:
            print(f"step {step + 1}/{train.steps} loss {loss.item():.6f}", flush=True)
            now = time.monotonic()
            metrics.write(step + 1, {"loss": loss.item(),  # type: ignore[union-attr]
                                     "step_time_s": (now - logged_at) / max(step + 1 - logged_step, 1)})
            logged_at, logged_step = now, step + 1
        if step + 1 == train.steps:
            break
        stopped_by = stop.agreed()  # every rank, every step boundary
        if stopped_by is not None:
            stopped_at = step + 1
        if rank == 0 and (stopped_by is not None or (step + 1) % ckpt.every_steps == 0):
            state = {"step": step + 1, "weights": weights}
            replace_atomically(state_path, lambda tmp, state=state: torch.save(state, tmp))
        if stopped_by is not None:
            print(f"rank {rank}: {stopped_by} received, stopping at step {stopped_at}", flush=True)
            dist.barrier()  # no rank leaves (and rank 0 requeues only) once the state file is in place
            break
    if metrics is not None:
        metrics.close()
    return {
        "mode": "spine",
        "allreduce_sum": probe.item(),
        "allreduce_expected": world * (world + 1) / 2,
        "resumed_from_step": start_step,
        "steps": train.steps,
        "stopped_by": stopped_by,
        "stopped_at_step": stopped_at,
        "final_loss": float(loss.item()),
        "weight_error": float((weights - true_w).norm().item()),
        "loop_s": time.monotonic() - t0,
    }
