"""Execute a plan on this machine, without Slurm (submitit's local executor).

Jobs run one after another (the local executor has no dependencies): training with all its ranks as local
processes (or the export of a checkpoint, for an evaluation of one), then the evaluation shards (at most
`array_parallelism` at a time), then the report. An `afterok` job whose dependency failed is recorded CANCELLED, as
Slurm would. States go to run.json, so `embodyhpc status` reads the same for both backends. Evaluations of
checkpoints that training asks for while it runs (JobSpec.starts_evals) run here too, beside training, as chains of
their own.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.environ import patched_environ
from embodyhpc.orchestrate.plan import JobSpec, chain_plan, resolve_task
from embodyhpc.rundir import (
    RESOLVED_YAML,
    JobRecord,
    RunInfo,
    requested_evals,
    script_file,
    submitit_folder,
    write_private,
)
from embodyhpc.slurm.render import job_shape, render_job

# a local training run gets the time limit of its recipe, plus slack for process start-up
_LOCAL_SLACK_MIN = 2
_POLL_S = 2.0  # while training runs: how often to look for checkpoints to evaluate

Progress = Callable[[str], None]


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


def run_local_chain(loaded: LoadedRecipe, run_dir: Path, info: RunInfo, progress: Progress = print, *,
                    eval_only: bool = False) -> RunInfo:
    """The recipe's chain (orchestrate.plan.chain_plan) on this machine; the scripts a cluster would get are
    written to scripts/ for reference."""
    plan = chain_plan(loaded, eval_only=eval_only)
    for job in plan:
        write_private(script_file(run_dir, job.kind), render_job(loaded, job.kind, run_dir, info.python))
    return run_local_plan(loaded, run_dir, info, plan, progress)


def run_local_plan(loaded: LoadedRecipe, run_dir: Path, info: RunInfo, plan: list[JobSpec],
                   progress: Progress = print) -> RunInfo:
    import submitit

    cfg = loaded.config
    folder = submitit_folder(run_dir)
    info.driver = f"{socket.gethostname()}:{os.getpid()}"  # status: once this process is gone, so is the chain

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

    def run_job(job: JobSpec, tasks: int, while_running: Callable[[], None] | None) -> str:
        handle = executor(job.kind, tasks).submit(resolve_task(job.task), str(run_dir))
        record(job.kind, job_id=str(handle.job_id), state="RUNNING")
        while while_running is not None and not handle.done():
            while_running()
            time.sleep(_POLL_S)
        state, reason, code = _outcome(handle)
        record(job.kind, state=state, reason=reason, exit_code=code)
        progress(f"{job.kind}: {state}" + (f" ({reason})" if reason else ""))
        return state

    for job in plan:
        record(job.kind, state="PENDING", dependency=f"{job.condition}:{':'.join(job.after)}" if job.after else None,
               array_size=job.array_size)

    env = {"EMBODYHPC_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", **dict(cfg.site.env),
           **cfg.network.environment()}
    states: dict[str, str] = {}
    with patched_environ(env):
        for job in plan:
            failed = [kind for kind in job.after if states.get(kind) != "COMPLETED"]
            if job.condition == "afterok" and failed:
                states[job.kind] = "CANCELLED"
                record(job.kind, state="CANCELLED", reason="DependencyNeverSatisfied",
                       array_counts={"CANCELLED": job.array_size} if job.array_size else {})
                progress(f"{job.kind}: CANCELLED ({failed[0]} failed)")
            elif job.array_size:
                states[job.kind] = _run_array(job, run_dir, executor(job.kind, 1), record, progress)
            else:
                shape = job_shape(loaded, job.kind)
                tasks = shape.nodes * shape.tasks_per_node  # every process of the job, here
                if job.kind == "train":
                    progress(f"{job.kind}: {tasks} local processes")
                background = _CheckpointEvals(run_dir, progress) if job.starts_evals else None
                states[job.kind] = run_job(job, tasks, background.poll if background else None)
                if background is not None:  # (an interrupted chain does not wait for them: the thread is a daemon)
                    background.finish()
    return info


class _CheckpointEvals:
    """Evaluations of checkpoints the training job asks for while it runs (embodyhpc.launch.checkpoint_eval makes
    their run directories under <run>/evals/): run here as local chains, one at a time, in a thread beside
    training. `poll` while training runs; `finish` after it, which waits for every evaluation asked for."""

    def __init__(self, run_dir: Path, progress: Progress) -> None:
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

        while (path := self.queue.get()) is not None:
            say = (lambda name: lambda message: self.progress(f"eval@{name}: {message}"))(path.name)
            try:
                say("evaluating the checkpoint beside training")
                run_local_chain(load_recipe(str(path / RESOLVED_YAML), recipe_site_keys="keep"), path,
                                RunInfo.load(path), progress=say, eval_only=True)
            except Exception as exc:  # noqa: BLE001 - one evaluation failing must not stop the others or training
                say(f"failed: {type(exc).__name__}: {exc}")


def _run_array(job: JobSpec, run_dir: Path, ex, record, progress: Progress) -> str:
    """Run the array's elements, `array_parallelism` at a time; FAILED when any element failed, with the first
    failed shard's own one-line reason (its exception's last line) in the record: what `submit --local` and `eval
    --local` print, so a user reads why without opening the shard's log."""
    counts: Counter = Counter(PENDING=job.array_size)
    first_failure: str | None = None
    ids: list[str] = []
    record(job.kind, state="RUNNING", array_counts=dict(counts))
    task = resolve_task(job.task)
    width = min(job.array_parallelism or job.array_size, job.array_size)
    for start in range(0, job.array_size, width):
        shards = list(range(start, min(start + width, job.array_size)))
        handles = ex.map_array(task, [str(run_dir)] * len(shards), shards)
        ids += [str(h.job_id) for h in handles]
        record(job.kind, job_id=ids[0], element_ids=list(ids))
        for shard, handle in zip(shards, handles, strict=True):
            state, reason, _ = _outcome(handle)
            if state != "COMPLETED" and first_failure is None:
                first_failure = f"shard {shard}: {reason}"
            counts["PENDING"] -= 1
            counts[state] += 1
            record(job.kind, array_counts={k: v for k, v in counts.items() if v})
        progress(f"{job.kind}: {counts['COMPLETED']}/{job.array_size} shards completed")
    failed = job.array_size - counts["COMPLETED"]
    state = "COMPLETED" if not failed else "FAILED"
    record(job.kind, state=state, exit_code=0 if not failed else 1,
           reason=f"{failed} shard(s) failed; first, {first_failure}" if failed else None)
    return state
