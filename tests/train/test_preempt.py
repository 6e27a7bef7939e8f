"""StopSignal in one process, and the launcher's decision after a stop (requeue once, or fail saying why).

The multi-rank behaviour (one rank signalled, all stop at one step, exact resume) is in test_loop.py; the real
requeue on Slurm is in tests/slurm/test_cluster.py.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from embodyhpc.errors import SlurmError
from embodyhpc.launch import train as launch_train
from embodyhpc.train.preempt import REQUEUE_EXIT_CODE, Requeued, Stopped, StopSignal
from tests.parallel.harness import run_ranks
from tests.train import workers


def test_a_signal_only_sets_a_flag_and_the_previous_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        with StopSignal() as stop:
            assert stop.agreed() is None
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.received == signal.SIGUSR2 and stop.agreed() == "SIGUSR2"
            assert seen == [], "the handler that was there before must not run while StopSignal is installed"
        os.kill(os.getpid(), signal.SIGUSR2)
        assert seen == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_sigusr2_outranks_sigterm_whatever_the_order():
    for order in ((signal.SIGTERM, signal.SIGUSR2), (signal.SIGUSR2, signal.SIGTERM)):
        stop = StopSignal()
        for sig in order:
            stop.request(sig)
        assert stop.agreed() == "SIGUSR2"
    stop = StopSignal()
    stop.request(signal.SIGTERM)
    assert stop.agreed() == "SIGTERM"
    with pytest.raises(ValueError, match="SIGINT"):
        stop.request(signal.SIGINT)


def test_requeued_and_stopped_leave_like_submitits_own_requeue():
    for exc, code in ((Requeued("requeued at step 7"), REQUEUE_EXIT_CODE), (Stopped("stopped at step 7"), 143)):
        assert isinstance(exc, SystemExit) and not isinstance(exc, Exception)  # submitit writes no result for it
        assert exc.code == code and str(exc).endswith("at step 7")


# ---- the launcher's decision (rank 0) ----
@pytest.fixture
def on_slurm(monkeypatch):
    calls: list[str] = []
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setattr("embodyhpc.slurm.commands.requeue", calls.append)
    return calls


def _decide(tmp_path, monkeypatch, *, restarts: int, max_requeues: int, signal_name: str = "SIGUSR2"):
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restarts))
    result = {"stopped_by": signal_name, "stopped_at_step": 120, "resumed_from_step": 40}
    decision = launch_train._decide_and_requeue(result, max_requeues, tmp_path, "4242")
    lines = (tmp_path / launch_train.ATTEMPTS_FILE).read_text().splitlines()
    return decision, [json.loads(line) for line in lines]


def test_below_the_limit_rank0_requeues_exactly_once(tmp_path, monkeypatch, on_slurm):
    decision, attempts = _decide(tmp_path, monkeypatch, restarts=1, max_requeues=3)
    assert on_slurm == ["4242"]
    assert decision["outcome"] == "requeued" and "step 120" in decision["message"]
    assert attempts == [{"job_id": "4242", "restart_count": 1, "outcome": "requeued", "signal": "SIGUSR2",
                         "step": 120, "resumed_from_step": 40, "message": decision["message"]}]


def test_at_the_limit_the_job_fails_and_says_why(tmp_path, monkeypatch, on_slurm):
    decision, attempts = _decide(tmp_path, monkeypatch, restarts=2, max_requeues=2)
    assert on_slurm == []
    assert decision["outcome"] == "failed" and attempts[0]["outcome"] == "failed"
    message = decision["message"]
    assert "resources.max_requeues=2" in message and "restarted 2 time(s)" in message and "step 120" in message


def test_sigterm_is_saved_but_not_requeued(tmp_path, monkeypatch, on_slurm):
    decision, _ = _decide(tmp_path, monkeypatch, restarts=0, max_requeues=3, signal_name="SIGTERM")
    assert on_slurm == [] and decision["outcome"] == "stopped"


def test_a_failed_requeue_fails_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")

    def refuse(job_id: str) -> None:
        raise SlurmError("scontrol requeue 4242 failed (1): Requested operation is presently disabled")

    monkeypatch.setattr("embodyhpc.slurm.commands.requeue", refuse)
    decision, _ = _decide(tmp_path, monkeypatch, restarts=0, max_requeues=3)
    assert decision["outcome"] == "failed" and "presently disabled" in decision["message"]


def test_local_executor_counts_its_own_requeues(tmp_path, monkeypatch):
    """submitit's local executor restarts the tasks on the requeue exit code but keeps no restart count: the
    attempts this job recorded are the count."""
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    result = {"stopped_by": "SIGUSR2", "stopped_at_step": 5, "resumed_from_step": 0}
    outcomes = [launch_train._decide_and_requeue(result, 2, tmp_path, "777")["outcome"] for _ in range(3)]
    assert outcomes == ["requeued", "requeued", "failed"]
    assert launch_train._restart_count(tmp_path, "778") == 0, "another job's attempts do not count"


def test_scontrol_inside_the_job_ignores_the_stop_signals_and_the_job_keeps_its_handler():
    """slurmstepd signals every process of the step, the requeue's scontrol included (seen: killed by SIGUSR2)."""
    from embodyhpc.slurm import commands

    script = ["bash", "-c", "kill -USR2 $$; kill -TERM $$; echo survived"]
    with pytest.raises(SlurmError, match="-12"):
        commands.run(script)  # bash dies of SIGUSR2 without protection
    with StopSignal() as stop:
        assert commands.run(script, immune_to=(signal.SIGUSR2, signal.SIGTERM)).strip() == "survived"
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.received == signal.SIGUSR2, "the parent's own handler is back after the command"


# ---- end to end under submitit's local executor: the requeue exit code restarts the tasks ----
def _local_rank_pid(runs_root, rank: int) -> int | None:
    """The process of training rank `rank` of a local run under runs_root (submitit's local task environment)."""
    from pathlib import Path

    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = b"submitit.core._submit" in cmdline and str(runs_root).encode() in cmdline
        if ours and f"SUBMITIT_LOCAL_GLOBALID={rank}".encode() in environ:
            return int(proc.name)
    return None


@pytest.mark.slow
def test_local_run_signalled_on_one_rank_restarts_and_resumes_at_the_saved_step(cli, runs_root):
    import threading

    from tests.helpers import run_dir_from, wait_for

    signalled: list[int] = []

    def signal_rank1_once_training_runs() -> None:
        wait_for(lambda: list(runs_root.glob("*/*/checkpoints/spine-state.pt")), 120, "a progress checkpoint")
        pid = wait_for(lambda: _local_rank_pid(runs_root, 1), 30, "rank 1's process")
        os.kill(pid, signal.SIGUSR2)
        signalled.append(pid)

    thread = threading.Thread(target=signal_rank1_once_training_runs, daemon=True)
    thread.start()
    result = cli("submit", "recipes/smoke_cpu.yaml", "--local", "--json", f"job.runs_root={runs_root}",
                 "train.steps=2000", "data.synthetic_step_s=0.005", "checkpoint.every_steps=100",
                 "train.log_every=100000", "eval.enabled=false")  # at least 10 s of paced steps on any machine
    thread.join(timeout=5)
    assert result.code == 0, result.err
    assert signalled, "rank 1 was never signalled"
    run_dir = run_dir_from(result.out)
    attempts = [json.loads(line) for line in (run_dir / launch_train.ATTEMPTS_FILE).read_text().splitlines()]
    assert [(a["outcome"], a["signal"], a["restart_count"]) for a in attempts] == [("requeued", "SIGUSR2", 0)]
    train = json.loads((run_dir / launch_train.RESULT_FILE).read_text())
    assert train["status"] == "completed" and train["steps"] == 2000
    assert train["resumed_from_step"] == attempts[0]["step"] and train["restart_count"] == 1


def test_the_run_status_follows_how_the_attempt_ended(tmp_path):
    """launch/observe.py (torch-free) turns the exceptions preempt.py raises into the MLflow run's status, and the
    W&B run's (tracking.backends: [mlflow, wandb]) the same way."""
    from embodyhpc.launch import observe

    closed = []

    from types import SimpleNamespace

    class Sink:
        def close(self, status, reason=None):
            closed.append((status, reason))

    for exc, status in ((Requeued("requeued at step 7"), "RUNNING"), (Stopped("stopped at step 7"), "KILLED"),
                        (SystemExit(1), "FAILED")):
        tracking = object.__new__(observe.RunTracking)
        tracking.sampler, tracking.sink, tracking.wandb = None, Sink(), Sink()
        tracking.config = SimpleNamespace(data=SimpleNamespace(format="synthetic", root=None))  # no dataset input
        with pytest.raises(SystemExit), tracking.attempt():
            raise exc
        assert closed == [(status, str(exc) or None)] * 2
        closed.clear()


def test_under_nccl_the_stop_agreement_and_hostname_gather_run_on_a_gloo_side_group_of_every_rank():
    """2 gloo ranks whose default group answers "nccl" to get_backend (a GPU job's main backend): cpu_group()
    creates one gloo group of the same ranks, and the CPU collectives run there, never on the (NCCL) default group."""
    results = run_ranks(workers.cpu_group_under_nccl_job, 2)
    for result in results:
        assert result["new_groups"] == [{"args": (), "backend": "gloo"}]  # one, of every rank of the world
        assert result["side_backend"] == "gloo" and result["side_ranks"] == [0, 1]
        assert result["agreed"] == "SIGUSR2"  # rank 1's signal reached rank 0 through the side group
        assert result["collectives"] == [("all_reduce", "side"), ("all_gather", "side")]
        assert result["num_hostnames"] == 2
