"""The commands' view of an RL run (its job kind "rl"): status, runs, logs and cancel on a run folder as the local
backend leaves it; (slow) the local backend running the RL job's shape as the sum of its groups' processes, then the
same commands through the CLI driver (tests/cli_driver.py); resume of an RL run (versions are its steps)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from embodyhpc.orchestrate.api import start_run
from embodyhpc.rundir import METRICS_FILE, make_run_dir, submitit_folder
from embodyhpc.runinfo import JobRecord, RunInfo
from embodyhpc.validation import load_recipe

REPO = Path(__file__).resolve().parents[1]
# smoke_cpu (train.steps 200) made an RL run: its progress is counted in versions (rl.iterations 20)
RL = ["rl.enabled=true", "model.init_weights=/models/sft", "rl.train_seeds=[100]", "rl.micro_batch_size=8",
      "rl.iterations=20", "rl.env_workers=2"]


def rl_run(root: Path, *, rl_state: str = "RUNNING", steps: tuple[int, ...] = (1, 2, 3)) -> Path:
    """A local RL run as `submit --local` leaves it while its rl job runs: resolved.yaml and run.json (start_run),
    the chain's records as the local backend writes them, the actor's metrics lines and one log file per task."""
    loaded = load_recipe("smoke_cpu", [*RL, f"job.runs_root={root}"])
    run = root / "rl" / "rl-20261126-120000"
    assert make_run_dir(run)
    info = start_run(loaded, run, backend="local", python=sys.executable, mlflow_run_id=None)
    info.driver = f"{socket.gethostname()}:{os.getpid()}"  # a live `submit`: this test process
    info.jobs = {"rl": JobRecord("rl", job_id="4242", state=rl_state),
                 "eval": JobRecord("eval", state="PENDING", array_size=4, dependency="afterok:rl"),
                 "report": JobRecord("report", state="PENDING", dependency="afterany:rl:eval")}
    info.save()
    with (run / METRICS_FILE).open("w") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 0.5, "step_time_s": 2.0}) + "\n")
    for task, role in enumerate(("actor", "rollout", "env", "env")):
        (submitit_folder(run) / f"4242_{task}_log.out").write_text(f"{role} {task} says hello\n")
    return run


def test_status_shows_the_rl_job_and_its_versions(cli, runs_root):
    run = rl_run(runs_root)
    result = cli("status", str(run))
    assert result.code == 0, result.err
    rows = {line.split()[0]: line.split() for line in result.out.splitlines()[1:] if line.split()}
    assert rows["rl"][1:3] == ["4242", "RUNNING"] and rows["eval"][2] == "PENDING"
    assert "rl: step 3/20 (15%), loss 0.5, 2 s/step, ETA 34s" in result.out  # 17 versions left at 2 s each
    data = json.loads(cli("status", str(run), "--json").out)
    assert (data["state"], data["state_of"], data["jobs"][0]["kind"]) == ("RUNNING", "rl", "rl")
    assert data["progress"]["total_steps"] == 20


def test_runs_lists_an_rl_run_with_its_versions(cli, runs_root):
    rl_run(runs_root)
    result = cli("runs", "--runs-root", str(runs_root), "--json")
    assert result.code == 0, result.err
    (row,) = json.loads(result.out)["runs"]
    assert (row["name"], row["state"], row["job"], row["step"], row["total_steps"]) == (
        "rl/rl-20261126-120000", "RUNNING", "rl", 3, 20)
    text = cli("runs", "--runs-root", str(runs_root)).out
    assert "RUNNING (rl)" in text and "3/20" in text


def test_logs_of_the_rl_job_and_cancel_of_a_local_rl_run(cli, runs_root):
    run = rl_run(runs_root, rl_state="COMPLETED")
    result = cli("logs", str(run), "--job", "rl")
    assert result.code == 0, result.err
    assert [line for line in result.out.splitlines() if line.startswith("=====")] == [
        f"===== rl task {task} out: {submitit_folder(run) / f'4242_{task}_log.out'}" for task in range(4)]
    assert "env 3 says hello" in result.out
    assert cli("logs", str(run), "--job", "rlx").code == 2
    result = cli("cancel", str(run))
    assert result.code == 0 and "local runs stop with their `embodyhpc submit` process" in result.out


def test_a_failed_rl_job_is_the_runs_state_with_its_reason(cli, runs_root):
    run = rl_run(runs_root, rl_state="FAILED")
    info = RunInfo.load(run)
    info.jobs["rl"].reason = "rollout worker 0 sent nothing for 120 s"
    info.save()
    result = cli("runs", "--runs-root", str(runs_root), "--json")
    (row,) = json.loads(result.out)["runs"]
    assert (row["state"], row["job"], row["reason"]) == ("FAILED", "rl", "rollout worker 0 sent nothing for 120 s")


# ---- the local backend: the RL job's processes are its groups' (the plan's shape), each told the role sizes ----
def record_rank(run_dir: str) -> None:
    """The RL job's task in these tests: each local process writes its rank and what the job's shape exported."""
    import submitit

    rank = submitit.JobEnvironment().global_rank
    line = f"{rank} {os.environ.get('EMBODYHPC_RL_SIZES')} {os.environ.get('EMBODYHPC_JOB_KIND')}\n"
    (Path(run_dir) / f"rank-{rank}.txt").write_text(line)


def test_the_local_backend_starts_as_many_processes_as_the_groups_hold(tmp_path, monkeypatch):
    """2 actor ranks on 1 node, 1 rollout worker, 2 env workers on each of 2 nodes: 2 + 1 + 4 = 7 processes (not
    the single allocation's 4 nodes x 2 per node that a site without het jobs would ask for)."""
    from embodyhpc.orchestrate import backend_local
    from embodyhpc.orchestrate.plan import JobSpec, make_plan

    loaded = load_recipe("smoke_cpu", [*RL, "rl.actor_ranks=2", "rl.micro_batch_size=8", "rl.resources.env.nodes=2",
                                       f"job.runs_root={tmp_path}"])
    run = tmp_path / "rl" / "rl-20261126-140000"
    assert make_run_dir(run)
    info = start_run(loaded, run, backend="local", python=sys.executable, mlflow_run_id=None)
    started: list[int] = []

    class Handle:  # what submitit's local executor answers: a job that completed
        job_id = "77"

        def done(self) -> bool:
            return True

        def results(self) -> list:
            return [None] * started[-1]

    class Executor:
        def __init__(self, tasks: int) -> None:
            started.append(tasks)

        def submit(self, fn, *args):
            return Handle()

    monkeypatch.setattr(backend_local._LocalChain, "executor", lambda self, job, tasks: Executor(tasks))
    said: list[str] = []
    plan = make_plan(loaded, [JobSpec("rl", "tests.test_rl_cli:record_rank")], run, sys.executable)
    backend_local.LocalBackend().submit(plan, info, progress=said.append)
    assert started == [7] and "rl: 7 local processes (2 actor, 1 rollout, 4 env)" in said
    assert RunInfo.load(run).jobs["rl"].state == "COMPLETED"


@pytest.mark.slow
def test_the_local_backend_runs_every_group_process_and_the_commands_read_the_run(tmp_path):
    from embodyhpc.orchestrate.backend_local import LocalBackend
    from embodyhpc.orchestrate.plan import JobSpec, make_plan

    loaded = load_recipe("smoke_cpu", [*RL, f"job.runs_root={tmp_path}"])
    run = tmp_path / "rl" / "rl-20261126-130000"
    assert make_run_dir(run)
    info = start_run(loaded, run, backend="local", python=sys.executable, mlflow_run_id=None)
    said: list[str] = []
    plan = make_plan(loaded, [JobSpec("rl", "tests.test_rl_cli:record_rank")], run, sys.executable)
    LocalBackend().submit(plan, info, progress=said.append)
    # 1 actor + 1 rollout + 2 env workers (rl.env_workers=2 on the env group's one node): 4 processes
    assert sorted(p.read_text() for p in run.glob("rank-*.txt")) == [
        f"{rank} actor=1,rollout=1,env=2 rl\n" for rank in range(4)]
    assert "rl: 4 local processes (1 actor, 1 rollout, 2 env)" in said
    record = RunInfo.load(run).jobs["rl"]
    assert (record.state, record.exit_code) == ("COMPLETED", 0) and record.job_id
    commands = [["status", str(run), "--json"], ["runs", "--runs-root", str(tmp_path), "--json"],
                ["logs", str(run), "--job", "rl"], ["cancel", str(run)]]
    listing = tmp_path / "commands.json"
    listing.write_text(json.dumps(commands))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "cli_driver.py"), str(listing)], capture_output=True,
                          text=True, cwd=REPO, timeout=120)
    status, runs, logs, cancel = json.loads(proc.stdout)
    assert [r["code"] for r in (status, runs, logs, cancel)] == [0, 0, 0, 0], proc.stderr
    assert [(j["kind"], j["state"]) for j in json.loads(status["out"])["jobs"]] == [("rl", "COMPLETED")]
    assert json.loads(runs["out"])["runs"][0]["state"] == "COMPLETED"
    assert logs["out"].count("===== rl task ") >= 4  # every process's stdout and stderr
