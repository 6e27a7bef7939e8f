"""The same chain on this machine, without Slurm (submitit's local executor).

Jobs run one after another (the local executor has no dependencies): training with all its
ranks as local processes, then the evaluation shards (at most `array_parallelism` at a time),
then the report. States go to run.json, so `embodyhpc status` reads the same for both backends.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

from embodyhpc.config.load import LoadedRecipe
from embodyhpc.environ import patched_environ
from embodyhpc.launch.eval import eval_shard_task
from embodyhpc.launch.report import report_task
from embodyhpc.launch.train import train_task
from embodyhpc.rundir import JobRecord, RunInfo
from embodyhpc.slurm.render import job_shape, submitit_folder

# a local training run gets the time limit of its recipe, plus slack for process start-up
_LOCAL_SLACK_MIN = 2


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
    return trace[-1][:300] if trace else ""


def run_local_chain(loaded: LoadedRecipe, run_dir: Path, info: RunInfo,
                    progress: Callable[[str], None] = print, *, eval_only: bool = False) -> RunInfo:
    import submitit

    cfg = loaded.config
    folder = submitit_folder(run_dir)

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

    with_eval = cfg.eval.enabled or eval_only
    if not eval_only:
        record("train", state="PENDING")
    if with_eval:
        record("eval", state="PENDING", array_size=cfg.eval.shards, dependency=None if eval_only else "afterok:train")
    record("report", state="PENDING", dependency="afterany:eval" if eval_only else "afterany:train:eval")

    env = {"EMBODYHPC_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", **dict(cfg.site.env),
           **cfg.network.environment()}
    with patched_environ(env):
        state = "COMPLETED"
        if not eval_only:
            world = loaded.resolved.world_size
            progress(f"train: {world} local processes")
            job = executor("train", world).submit(train_task, str(run_dir))
            record("train", job_id=str(job.job_id), state="RUNNING")
            state, reason, code = _outcome(job)
            record("train", state=state, reason=reason, exit_code=code)
            progress(f"train: {state}" + (f" ({reason})" if reason else ""))

        if with_eval and state == "COMPLETED":
            _run_eval(loaded, run_dir, executor("eval", 1), record, progress)
        elif with_eval:
            record("eval", state="CANCELLED", reason="DependencyNeverSatisfied",
                   array_counts={"CANCELLED": cfg.eval.shards})
            progress("eval: CANCELLED (training failed)")

        job = executor("report", 1).submit(report_task, str(run_dir))
        record("report", job_id=str(job.job_id), state="RUNNING")
        state, reason, code = _outcome(job)
        record("report", state=state, reason=reason, exit_code=code)
        progress(f"report: {state}" + (f" ({reason})" if reason else ""))
    return info


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
