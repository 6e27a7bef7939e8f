"""Where per-step metrics go: a `MetricsSink` protocol, a JSON-lines file and the console.

Sinks run on rank 0 only and must never run collectives (the other ranks would not join them); the loop reduces
across ranks before handing a finished dict over. MLflow plugs in later as one more sink with the same two
methods.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

METRIC_FIELDS = ("loss", "lr", "grad_norm", "step_time_s", "samples_per_s_per_device", "tokens_per_s",
                 "data_wait_fraction")
"""The fields every logged step carries (besides `step`). Optional: `packing_efficiency` (useful tokens / token
budget of the micro-batches), logged when the collate packs samples into rows; `data_skipped_samples` (bad samples
skipped so far, all ranks), logged with data.on_bad_sample=skip. Rank 0's data loader, since the previous log
step (train/stream.py loader_metrics): `data_decode_ms_per_sample` (video decode time per sample in its workers) and
`data_loader_samples_per_s` (samples its workers deliver per second while busy)."""
LOADER_FIELDS = ("data_decode_ms_per_sample", "data_loader_samples_per_s")


def logs_at(step: int, log_every: int, last_step: int) -> bool:
    """Whether optimizer step `step` (1-based) logs its metrics: every `log_every` steps (train.log_every), and the
    run's last step whatever it is."""
    return step % log_every == 0 or step == last_step


class MetricsSink(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of optimizer step `step` (1-based)."""

    def close(self) -> None:
        """Flush and release; called once at the end of training."""


class JsonlMetricsSink:
    """Appends one JSON object per logged step to `path` (run_dir/logs/metrics.jsonl).

    On resume from step N, lines for steps after N are dropped first: a job that died after N logged steps it
    then had to redo, and one file should hold one continuous curve with no duplicate steps.
    """

    def __init__(self, path: str | Path, *, resume_step: int = 0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(f"{line}\n" for line in kept))
            tmp.replace(self.path)
        self._file = self.path.open("a")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        record = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                   for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # a killed job keeps every step it logged

    def close(self) -> None:
        self._file.close()


class ConsoleMetricsSink:
    """One line per logged step on stdout (the Slurm job's log file)."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        parts = " ".join(f"{key}={value:.4g}" for key, value in metrics.items())
        print(f"step {step} {parts}", flush=True)

    def close(self) -> None:
        pass
