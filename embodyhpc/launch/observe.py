"""What the training job reports besides checkpoints: node preflight, MLflow metrics, per-node telemetry.

- preflight: local rank 0 of every node checks its node before anything else (embodyhpc.hw.preflight); a bad node
  raises NodeUnhealthy naming the node to --exclude, and srun's --kill-on-bad-exit ends the other ranks at once.
- MLflow: rank 0 continues the run `submit` created (its id is in run.json) with the loop's metrics. The run's
  end status follows the attempt: FINISHED when training completed, RUNNING when the job was requeued (the next
  attempt continues it), FAILED otherwise. A tracking store that cannot be reached never stops training.
- MLflow inputs: rank 0 logs the training dataset as the run's dataset input (name, path, episode count,
  fingerprint) when the attempt starts; a failed attempt ends the run FAILED with the exception as its failure
  reason (tag embodyhpc.failure_reason, and a line in the description).
- telemetry: local rank 0 of every node samples GPUs and the host every tracking.telemetry_interval_s into the
  same MLflow run under MLflow's system-metrics names (system/node_<i>/...: the System metrics tab), through its
  own sink (the sampler runs on its own thread); a requeued job continues the node's sample numbers.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from embodyhpc.config.schema import Config
from embodyhpc.errors import REQUEUE_EXIT_CODE, STOPPED_EXIT_CODE
from embodyhpc.runinfo import RunInfo


def node_name() -> str:
    """Slurm's name for this node (what --exclude takes), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def preflight(run_dir: Path, config: Config, local_rank: int) -> None:
    from embodyhpc.hw.preflight import run_preflight_for_job

    result = run_preflight_for_job(run_dir, config, local_rank, node_name())
    if result is not None:
        print(f"preflight {result.node}: {result.status} in {result.elapsed_s:.2f} s", flush=True)


class _KeepOpen:
    """Forwards metrics to the MLflow sink; the loop's close() is ignored so the launcher can end the run with the
    status the attempt deserves (see RunTracking.finish)."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.sink.write(step, metrics)

    def close(self) -> None:
        self.sink.flush(force=True)


def wandb_sink_for(config: Config, run_dir: Path, mlflow_run_id: str) -> Any:
    """The W&B sink of a recipe whose tracking.backends lists wandb (None otherwise): its run id kept in the run
    folder across resume and requeue (the MLflow run id the first time), the project the recipe names."""
    from embodyhpc.tracking import wandb_sink

    if not wandb_sink.enabled(config.tracking):
        return None
    project = config.tracking.wandb_project or config.tracking.experiment or config.job.experiment
    return wandb_sink.WandbSink(run_dir, config.tracking, project=project,
                                run_id=wandb_sink.wandb_run_id(run_dir, mlflow_run_id), name=run_dir.name)


class RunTracking:
    """The MLflow side of one training attempt on one rank (inactive where there is nothing to do)."""

    def __init__(self, config: Config, run_dir: Path, *, rank: int, local_rank: int, node_rank: int = 0) -> None:
        self.sink = None
        self.wandb = None  # tracking.backends: [mlflow, wandb] (rank 0): the same metrics, offline by default
        self.sampler = None
        self.config = config
        run_id = None
        if config.tracking.enabled:
            with contextlib.suppress(Exception):  # no run.json (tests calling train_task) = no tracking
                run_id = RunInfo.load(run_dir).mlflow_run_id
        if run_id is None:
            return
        from embodyhpc.tracking.mlflow_run import tracking_uri
        from embodyhpc.tracking.mlflow_sink import MlflowMetricsSink

        uri = tracking_uri(config.tracking, config.job.runs_root)
        self.uri, self.run_id = uri, run_id
        if rank == 0:
            self.sink = MlflowMetricsSink(uri, run_id, prefix="train/")
            self.wandb = wandb_sink_for(config, run_dir, run_id)
        interval = config.tracking.telemetry_interval_s
        if local_rank == 0 and interval > 0:
            from embodyhpc.tracking.telemetry import TelemetrySampler, node_id

            sink = MlflowMetricsSink(uri, run_id, owns_status=False)
            self.sampler = TelemetrySampler(sink, node=node_name(), node_index=node_rank, interval_s=interval,
                                            first_step=sink.next_step(f"system/{node_id(node_rank)}/"))

    def sinks(self) -> list[Any]:
        """Extra metric sinks for the loop (rank 0 only)."""
        return ([_KeepOpen(self.sink)] if self.sink is not None else []) + \
            ([_KeepOpen(self.wandb)] if self.wandb is not None else [])

    @contextlib.contextmanager
    def attempt(self) -> Iterator[RunTracking]:
        """Telemetry while training runs; the run's status from how the attempt ended."""
        if self.sampler is not None:
            self.sampler.start()
        if self.sink is not None:
            self._log_dataset()
        status, reason = "FAILED", None
        try:
            yield self
            status = self.outcome_status
        except SystemExit as exc:  # preempt.Requeued: the next attempt continues the run; Stopped: Slurm ended it
            status = {REQUEUE_EXIT_CODE: "RUNNING", STOPPED_EXIT_CODE: "KILLED"}.get(exc.code, "FAILED")
            reason = str(exc) or None
            raise
        except BaseException as exc:
            reason = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self.sampler is not None:
                self.sampler.stop()
                self.sampler.sink.close()  # sends what is left; this sink never changes the run's status
            if self.sink is not None:
                self.sink.close(status, reason=reason)
            if self.wandb is not None:
                self.wandb.close(status, reason=reason)

    def _log_dataset(self) -> None:
        """The training dataset as the run's MLflow input; a problem here costs that record, never the training."""
        data = self.config.data
        if data.format == "synthetic" or not (data.root or data.datasets):
            return
        # a mixture (data.datasets): one input per dataset, with its weight and its share of the samples
        total = sum(entry.weight for entry in data.datasets or ())
        sources = [(data.root, {})] if data.root else [
            (entry.root, {"weight": entry.weight, "share": entry.weight / total, "mixture_index": i,
                          "embodiment": entry.embodiment}) for i, entry in enumerate(data.datasets or ())]
        for root, mixture in sources:
            try:
                from embodyhpc.data.info import dataset_fingerprint, dataset_info
                from embodyhpc.tracking.provenance import log_dataset

                info = dataset_info(root)
                log_dataset(self.uri, self.run_id, name=Path(str(root)).name, path=str(root),
                            num_episodes=info.get("num_episodes"), fingerprint=dataset_fingerprint(root),
                            profile={"num_frames": info.get("num_frames"), "format": info.get("format"),
                                     "fps": info.get("fps"), **mixture})
            except Exception as exc:  # noqa: BLE001
                print(f"embodyhpc: the dataset input {root} of MLflow run {self.run_id} was not logged: {exc}",
                      flush=True)

    outcome_status = "FINISHED"

    def log_final(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.sink is not None:
            self.sink.write(step, metrics)
