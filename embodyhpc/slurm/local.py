"""The same chain on this machine, without Slurm (submitit's local executor).

Jobs run one after another (the local executor has no dependencies): training with all its
ranks as local processes (or the export of a checkpoint, for an evaluation of one), then the evaluation shards
(at most `array_parallelism` at a time), then the report. States go to run.json, so `embodyhpc status` reads the
same for both backends. Evaluations of checkpoints that training asks for while it runs
(eval.every_k_checkpoints) run here too, beside training, as chains of their own.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.environ import patched_environ
from embodyhpc.launch.checkpoint_eval import requested_evals
from embodyhpc.launch.eval import eval_shard_task
from embodyhpc.launch.export import export_task
from embodyhpc.launch.report import report_task
from embodyhpc.launch.train import train_task
from embodyhpc.rundir import RESOLVED_YAML, JobRecord, RunInfo
from embodyhpc.slurm.render import chain_kinds, job_shape, submitit_folder

# a local training run gets the time limit of its recipe, plus slack for process start-up
_LOCAL_SLACK_MIN = 2
_POLL_S = 2.0  # while training runs: how often to look for checkpoints to evaluate


def _outcome(job) -> tuple[str, str | None, int | None]:
    try:
        job.results()
    except Exception as exc:  # noqa: BLE001 - any failure of the task is a FAILED job
        return "FAILED", _last_error_line(str(exc)) or type(exc).__name__, 1
    return "COMPLETED", None, 0


def _last_error_line(text: str) -> str:
    """The exception line of the task's traceback inside submitit's FailedJobError text."""
    lines = [line.strip() for line in text.splitlines()]
    cuts = [i for i, line in enumerate(lines) if line.startswith("-----")]
    trace = lines[cuts[0] + 1: cuts[1]] if len(cuts) >= 2 else lines
    trace = [line for line in trace if line]
    # run.json refuses control characters (status prints this): an escape sequence in a message is dropped
    return re.sub(r"[\x00-\x1f\x7f]", "", trace[-1])[:300] if trace else ""


def run_local_chain(loaded: LoadedRecipe, run_dir: Path, info: RunInfo,
                    progress: Callable[[str], None] = print, *, eval_only: bool = False) -> RunInfo:
    import submitit

    cfg = loaded.config
    folder = submitit_folder(run_dir)
    kinds = chain_kinds(loaded, eval_only=eval_only)

    def executor(kind: str, tasks: int) -> submitit.LocalExecutor:
        ex = submitit.LocalExecutor(folder=folder)
        ex.update_parameters(timeout_min=job_shape(loaded, kind).time_min + _LOCAL_SLACK_MIN,
                             tasks_per_node=tasks, nodes=1)
        return ex

    def record(kind: str, **fields) -> JobRecord:
        rec = info.jobs.setdefault(kind, JobRecord(kind=kind))
        for key, value in fields.items():
            setattr(rec, key, value)
        info.save()
        return rec

    def run_job(kind: str, task: Callable, tasks: int = 1, while_running: Callable[[], None] | None = None) -> str:
        job = executor(kind, tasks).submit(task, str(run_dir))
        record(kind, job_id=str(job.job_id), state="RUNNING")
        while while_running is not None and not job.done():
            while_running()
            time.sleep(_POLL_S)
        state, reason, code = _outcome(job)
        record(kind, state=state, reason=reason, exit_code=code)
        progress(f"{kind}: {state}" + (f" ({reason})" if reason else ""))
        return state

    upstream = next((k for k in kinds if k in ("train", "export")), None)  # what the evaluation waits for
    for kind in kinds:
        dependency = f"afterok:{upstream}" if kind == "eval" and upstream else None
        if kind == "report":
            dependency = "afterany:" + ":".join(k for k in kinds if k != "report")
        record(kind, state="PENDING", dependency=dependency, array_size=cfg.eval.shards if kind == "eval" else 0)

    env = {"EMBODYHPC_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", **dict(cfg.site.env),
           **cfg.network.environment()}
    with patched_environ(env):
        state = "COMPLETED"
        if "train" in kinds:
            world = loaded.resolved.world_size
            progress(f"train: {world} local processes")
            background = _CheckpointEvals(run_dir, progress) if cfg.eval.every_k_checkpoints else None
            state = run_job("train", train_task, world, background.poll if background else None)
            if background is not None:  # (an interrupted chain does not wait for them: the thread is a daemon)
                background.finish()
        if "export" in kinds:
            state = run_job("export", export_task)
        if "eval" in kinds and state == "COMPLETED":
            _run_eval(loaded, run_dir, executor("eval", 1), record, progress)
        elif "eval" in kinds:
            record("eval", state="CANCELLED", reason="DependencyNeverSatisfied",
                   array_counts={"CANCELLED": cfg.eval.shards})
            progress(f"eval: CANCELLED ({upstream} failed)")
        run_job("report", report_task)
    return info


class _CheckpointEvals:
    """Evaluations of checkpoints the training job asks for while it runs (embodyhpc.launch.checkpoint_eval makes
    their run directories under <run>/evals/): run here as local chains, one at a time, in a thread beside
    training. `poll` while training runs; `finish` after it, which waits for every evaluation asked for."""

    def __init__(self, run_dir: Path, progress: Callable[[str], None]) -> None:
        self.run_dir = run_dir
        self.progress = progress
        self.seen: set[Path] = set()
        self.queue: queue.Queue[Path | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="checkpoint-evals", daemon=True)
        self.thread.start()

    def poll(self) -> None:
        for path in requested_evals(self.run_dir):
            if path not in self.seen:
                self.seen.add(path)
                self.queue.put(path)

    def finish(self) -> None:
        self.poll()  # one asked for just before training ended
        self.queue.put(None)
        self.thread.join()

    def _work(self) -> None:
        from embodyhpc.config.load import load_recipe
        from embodyhpc.submit import run_chain

        while (path := self.queue.get()) is not None:
            say = (lambda name: lambda message: self.progress(f"eval@{name}: {message}"))(path.name)
            try:
                say("evaluating the checkpoint beside training")
                run_chain(load_recipe(str(path / RESOLVED_YAML), recipe_site_keys="keep"), RunInfo.load(path),
                          progress=say, eval_only=True)
            except Exception as exc:  # noqa: BLE001 - one evaluation failing must not stop the others or training
                say(f"failed: {type(exc).__name__}: {exc}")


def _run_eval(loaded: LoadedRecipe, run_dir: Path, ex, record, progress) -> None:
    ev = loaded.config.eval
    counts: Counter = Counter(PENDING=ev.shards)
    ids: list[str] = []
    record("eval", state="RUNNING", array_counts=dict(counts))
    width = min(ev.array_parallelism, ev.shards)
    for start in range(0, ev.shards, width):
        shards = list(range(start, min(start + width, ev.shards)))
        jobs = ex.map_array(eval_shard_task, [str(run_dir)] * len(shards), shards)
        ids += [str(j.job_id) for j in jobs]
        record("eval", job_id=ids[0], element_ids=list(ids))
        for job in jobs:
            state, _, _ = _outcome(job)
            counts["PENDING"] -= 1
            counts[state] += 1
            record("eval", array_counts={k: v for k, v in counts.items() if v})
        progress(f"eval: {counts['COMPLETED']}/{ev.shards} shards completed")
    failed = ev.shards - counts["COMPLETED"]
    record("eval", state="COMPLETED" if not failed else "FAILED", exit_code=0 if not failed else 1,
           reason=f"{failed} shard(s) failed" if failed else None)
