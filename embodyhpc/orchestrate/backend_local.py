"""Execute a plan on this machine, without Slurm (submitit's local executor): `LocalBackend`.

Jobs run one after another (the local executor has no dependencies): training with all its ranks as local
processes (an RL run's job: the processes of all its groups, actor, rollout and env, as the plan's shape counts
them; or the export of a checkpoint, for an evaluation of one), then the evaluation shards (at most
`array_parallelism` at a time), then the report. Each job runs with its shape from the plan: its processes, its
time limit (plus slack for process start-up) and its environment (what its sbatch script would export, with
OMP_NUM_THREADS=1). An `afterok` job whose dependency failed is recorded CANCELLED, as Slurm would. States go to
run.json, so `embodyhpc status` reads the same for both backends. Evaluations of checkpoints that training asks for
while it runs (JobSpec.starts_evals) run here too, beside training, as chains of their own (orchestrate.api).
The plan's scripts are written to scripts/ for reference; nothing here renders or plans.
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
from typing import TYPE_CHECKING

from embodyhpc.environ import patched_environ
from embodyhpc.plugins import import_name
from embodyhpc.rundir import RESOLVED_YAML, requested_evals, submitit_folder, write_private
from embodyhpc.runinfo import JobRecord, RunInfo

if TYPE_CHECKING:
    from embodyhpc.orchestrate.plan import Job, Plan

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


class LocalBackend:
    """The local machine as a backend (orchestrate.api.Backend)."""

    cancel_note = "local runs stop with their `embodyhpc submit` process (Ctrl-C); nothing to cancel"

    def submit(self, plan: Plan, info: RunInfo, progress: Progress = print) -> RunInfo:
        """Run the plan's jobs here, in order; returns when the chain has ended."""
        return _LocalChain(plan, info, progress).run()

    def poll(self, info: RunInfo) -> dict[str, str]:
        """Each job's state as the chain recorded it in run.json."""
        return {kind: record.state or "UNKNOWN" for kind, record in info.jobs.items()}

    def cancel(self, info: RunInfo) -> list[str]:
        return []  # the jobs are processes of the command that runs the chain: cancel_note


class _LocalChain:
    def __init__(self, plan: Plan, info: RunInfo, progress: Progress) -> None:
        self.plan, self.info, self.progress = plan, info, progress
        self.folder = submitit_folder(plan.run_dir)

    def run(self) -> RunInfo:
        info, run_dir = self.info, self.plan.run_dir
        info.driver = f"{socket.gethostname()}:{os.getpid()}"  # status: once this process is gone, so is the chain
        for job in self.plan.jobs:  # what a cluster would get, for reference
            write_private(job.script_path, job.script)
        for job in self.plan.jobs:
            spec = job.spec
            self.record(job.kind, state="PENDING", array_size=spec.array_size,
                        dependency=f"{spec.condition}:{':'.join(spec.after)}" if spec.after else None)
        states: dict[str, str] = {}
        for job in self.plan.jobs:
            spec = job.spec
            failed = [kind for kind in spec.after if states.get(kind) != "COMPLETED"]
            if spec.condition == "afterok" and failed:
                states[job.kind] = "CANCELLED"
                self.record(job.kind, state="CANCELLED", reason="DependencyNeverSatisfied",
                            array_counts={"CANCELLED": spec.array_size} if spec.array_size else {})
                self.progress(f"{job.kind}: CANCELLED ({failed[0]} failed)")
                continue
            with patched_environ({**job.shape.env, "OMP_NUM_THREADS": "1"}):
                if spec.array_size:
                    states[job.kind] = _run_array(job, run_dir, self.executor(job, 1), self.record, self.progress)
                else:
                    states[job.kind] = self.run_one(job)
        return info

    def executor(self, job: Job, tasks: int):
        import submitit

        ex = submitit.LocalExecutor(folder=self.folder)
        ex.update_parameters(timeout_min=job.shape.time_min + _LOCAL_SLACK_MIN, tasks_per_node=tasks, nodes=1)
        return ex

    def record(self, kind: str, **fields) -> JobRecord:
        rec = self.info.jobs.setdefault(kind, JobRecord(kind=kind))
        for key, value in fields.items():
            setattr(rec, key, value)
        self.info.save()
        return rec

    def run_one(self, job: Job) -> str:
        tasks = job.shape.tasks  # every process of the job, here (an RL job's: its groups' together)
        if job.shape.groups:  # each process finds its role from its rank (embodyhpc.rl.roles)
            roles = ", ".join(f"{group.tasks} {group.role}" for group in job.shape.groups)
            self.progress(f"{job.kind}: {tasks} local processes ({roles})")
        elif job.kind == "train":
            self.progress(f"{job.kind}: {tasks} local processes")
        background = _CheckpointEvals(self.plan.run_dir, self.progress) if job.spec.starts_evals else None
        handle = self.executor(job, tasks).submit(import_name(job.spec.task), str(self.plan.run_dir))
        self.record(job.kind, job_id=str(handle.job_id), state="RUNNING")
        while background is not None and not handle.done():
            background.poll()
            time.sleep(_POLL_S)
        state, reason, code = _outcome(handle)
        self.record(job.kind, state=state, reason=reason, exit_code=code)
        self.progress(f"{job.kind}: {state}" + (f" ({reason})" if reason else ""))
        if background is not None:  # (an interrupted chain does not wait for them: the thread is a daemon)
            background.finish()
        return state


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
        from embodyhpc.orchestrate.api import run_chain
        from embodyhpc.validation import load_recipe

        while (path := self.queue.get()) is not None:
            say = (lambda name: lambda message: self.progress(f"eval@{name}: {message}"))(path.name)
            try:
                say("evaluating the checkpoint beside training")  # its own chain, planned as any (api.run_chain)
                run_chain(load_recipe(str(path / RESOLVED_YAML), recipe_site_keys="keep"), RunInfo.load(path),
                          progress=say, eval_only=True)
            except Exception as exc:  # noqa: BLE001 - one evaluation failing must not stop the others or training
                say(f"failed: {type(exc).__name__}: {exc}")


def _run_array(job: Job, run_dir: Path, ex, record, progress: Progress) -> str:
    """Run the array's elements, `array_parallelism` at a time; FAILED when any element failed, with the first
    failed shard's own one-line reason (its exception's last line) in the record: what `submit --local` and `eval
    --local` print, so a user reads why without opening the shard's log."""
    size, kind = job.spec.array_size, job.kind
    counts: Counter = Counter(PENDING=size)
    first_failure: str | None = None
    ids: list[str] = []
    record(kind, state="RUNNING", array_counts=dict(counts))
    task = import_name(job.spec.task)
    width = min(job.spec.array_parallelism or size, size)
    for start in range(0, size, width):
        shards = list(range(start, min(start + width, size)))
        handles = ex.map_array(task, [str(run_dir)] * len(shards), shards)
        ids += [str(h.job_id) for h in handles]
        record(kind, job_id=ids[0], element_ids=list(ids))
        for shard, handle in zip(shards, handles, strict=True):
            state, reason, _ = _outcome(handle)
            if state != "COMPLETED" and first_failure is None:
                first_failure = f"shard {shard}: {reason}"
            counts["PENDING"] -= 1
            counts[state] += 1
            record(kind, array_counts={k: v for k, v in counts.items() if v})
        progress(f"{kind}: {counts['COMPLETED']}/{size} shards completed")
    failed = size - counts["COMPLETED"]
    state = "COMPLETED" if not failed else "FAILED"
    record(kind, state=state, exit_code=0 if not failed else 1,
           reason=f"{failed} shard(s) failed; first, {first_failure}" if failed else None)
    return state
